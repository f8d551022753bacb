"""Which configurations of a model fit a device, from its files' headers alone (``diffusiond fit``, ``offload=auto``).

A model too big for the card can still run (fp8 storage, offloading of blocks, components or layers). Which way
fits is arithmetic over the tensors' sizes, so it is answered before anything loads, in the command line process
and the engine (neither loads torch): safetensors headers (``sizes.read_tensors``) and GGUF headers (``gguf_header``).

What each configuration keeps on the device, and the rule the worker counts by too (pipelines/offload.py, on
the loaded modules, so that residency's budget and this page agree):

- ``none``: every tensor, at the model's dtype (quantized GGUF tensors as stored: diffusers keeps them so and
  dequantizes each layer's weight as it runs).
- ``fp8``: the denoiser's float tensors at 1 byte each (``quant=transformer:fp8-storage``, pipelines/quant.py;
  norms and embeddings really stay at the dtype, so this is an under-count of a few per cent), the rest as
  ``none``. Approximate: outputs differ.
- ``group``: the denoiser by diffusers' ``block_level`` groups (each direct child that is a ModuleList of blocks
  is split one block per group; everything else of the denoiser is one group on the device for the whole
  forward), the other components by ``leaf_level`` groups (one leaf module each). With ``use_stream`` the next
  group is copied while the current one runs, so the estimate is, for the largest component: what is always
  there plus twice its largest group. All weights wait in pinned host memory.
- ``stream``: as many of the denoiser's blocks as the budget has room for stay resident, the rest stream
  through a ring of slots (``pipelines/stream_plan.py``'s arithmetic, shared with the worker): the denoiser's
  parts outside its blocks, its resident blocks, the ring (depth x the largest streamed block), plus what the
  largest other component keeps there under leaf-level group offloading. The number of resident blocks is
  the largest whose figure and its working memory fit the budget; without a budget (or when nothing fits)
  the row shows the least it runs with (none resident, unless the ring would outweigh the blocks). Not
  offered for a quantized denoiser (GGUF), whose tensors cannot stream.
- ``model``: the largest component (diffusers' model offload moves one whole component at a time);
  ``sequential``: the largest leaf module (accelerate moves each layer's weights in for its forward).

Working memory is counted beside the weights as residency does (``working.default_working``, 1024x1024 unless told).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Final

import diffusiond.pipelines.stream_plan as stream_plan
from diffusiond.daemon.residency import auto_skips as skipped
from diffusiond.daemon.residency.fit_options import DENOISERS, refused, spec_approximations
from diffusiond.daemon.residency.fit_tensors import QUANT_WIDTH, Tensor, quantize
from diffusiond.daemon.residency.gguf_header import FLOAT_TYPES, STORED_BF16, read_gguf
from diffusiond.daemon.residency.sizes import (
    DTYPE_BITS,
    FLOATS,
    TARGET_BYTES,
    WeightsError,
    component_files,
    read_tensors,
)
from diffusiond.daemon.residency.units import format_bytes
from diffusiond.daemon.residency.working import Shape, default_working
from diffusiond.pipelines.errors import PipelineError
from diffusiond.pipelines.modelcache import cache_root, is_complete
from diffusiond.pipelines.preset_tables import folder_name, get_preset
from diffusiond.pipelines.spec import (
    ModelSpec,
    check_spec,
    offload_mode,
    parse_spec,
    resident_blocks,
)
from diffusiond.pipelines.variants import NOT_LOADED

MODES: Final = ("none", "model", "group", "sequential", "stream", "auto")
"""The values of the ``offload`` model option (docs/api.md)."""
ORDER: Final = ("none", "fp8", "stream", "group", "model", "sequential")
"""Fastest first: what ``fit`` lists and the order ``auto`` tries (skipping the report's ``auto_skips``)."""
# LIST.INDEX of a denoiser's block; FLUX's and Wan's blocks under ComfyUI's prefix (a GGUF as downloaded) are
# grouped as without it, as diffusers loads them (an LDM UNet's input_blocks under the same prefix are not
# diffusers' blocks), and the original Wan layout's embeddings (nn.Sequential, so ``time_embedding.0.``) are
# not blocks: diffusers loads them into its condition_embedder, which stays on the device (issue 28)
_BLOCK = re.compile(r"^(?:model\.diffusion_model\.(?=(?:double_|single_)?blocks\.))?"
                    r"(?!(?:time_embedding|text_embedding|time_projection)\.)([A-Za-z_]\w*)\.(\d+)\.")
# single-file checkpoints (original layouts): key prefix -> component
_CHECKPOINT_PREFIXES: Final = (("model.diffusion_model.", "unet"), ("first_stage_model.", "vae"), ("vae.", "vae"),
                               ("cond_stage_model.", "text_encoder"), ("conditioner.", "text_encoder"),
                               ("text_encoders.", "text_encoder"))


@dataclass(frozen=True)
class Configuration:
    """One way to run the model: its option, what it keeps on the device and in host memory."""

    name: str  # ORDER's
    option: str  # the model option that asks for it
    device_bytes: int  # weights kept on the device (the figure residency counts the model at)
    host_bytes: int  # weights waiting in host memory
    working_bytes: int  # activations, estimated as residency does
    approximations: tuple[str, ...] = ()
    fits: bool | None = None  # None: no budget was given
    note: str = ""
    resident_blocks: int | None = None  # stream: the denoiser blocks it keeps on the device
    blocks: int | None = None  # stream: of how many

    @property
    def needs(self) -> int:
        return self.device_bytes + self.working_bytes


@dataclass(frozen=True)
class FitReport:
    spec: str
    dtype: str
    budget: int | None
    components: Mapping[str, int]  # bytes at the dtype, per component
    configurations: tuple[Configuration, ...]
    notes: tuple[str, ...] = field(default_factory=tuple)
    # what auto passes over for this model (auto_skips.py): required, so that no report built by hand falls back
    # to another model's rule
    auto_skips: Mapping[str, str] = field(kw_only=True)

    @property
    def fitting(self) -> tuple[Configuration, ...]:
        return tuple(c for c in self.configurations if c.fits is not False)


def _gguf_quantized(t: Tensor) -> bool:
    """A GGUF file's quantized tensor (Q8_0, Q4_K, ...): kept as stored, dequantized per layer as it runs."""
    return t.kind not in FLOATS | FLOAT_TYPES and t.kind not in DTYPE_BITS and t.kind not in QUANT_WIDTH


def model_tensors(spec: str, options: Mapping[str, str] | None = None,
                  dtype: str = "bfloat16") -> tuple[dict[str, list[Tensor]], list[str]]:
    """Component -> tensors of the model a spec names, read from headers, its ``quant=`` components' weights at
    their quantized width; and notes on what was assumed. Specs built in code (tiny, random:, synthetic) have
    no files to read: a WeightsError says so."""
    check_spec(spec, options)  # what serve refuses at start, fit refuses too
    parsed = parse_spec(spec)
    opts = {**parsed.options, **(options or {})}
    components, notes = _files(spec, parsed, opts, dtype)
    return quantize(components, opts.get("quant", ""), notes, opts.get("fp8", "")), notes


def _files(spec: str, parsed: ModelSpec, opts: Mapping[str, str], dtype: str,
           ) -> tuple[dict[str, list[Tensor]], list[str]]:
    notes: list[str] = []
    if parsed.kind == "hub":
        return _folder(hub_folder(parsed.target), dtype), notes
    if parsed.kind == "folder":
        return _folder(Path(parsed.target), dtype), notes
    if parsed.kind in ("checkpoint", "gguf"):
        single = parsed.kind == "checkpoint"
        components = _checkpoint(Path(parsed.target)) if single else {"transformer": gguf_tensors(Path(parsed.target))}
        if not single and opts.get("transformer_2"):  # Wan 2.2 A14B's low-noise expert, its own file (issue 28)
            components["transformer_2"] = gguf_tensors(Path(opts["transformer_2"]).expanduser())
        rest = opts.get("config" if single else "base", "")
        if rest:  # what the loader takes from the folder beside the file: the components the file lacks
            counted = tuple(components)
            denoiser = any(c in DENOISERS for c in counted)
            # a checkpoint's text_encoder holds the base's text_encoder_2 too; a GGUF replaces only what it names
            components.update({k: v for k, v in model_tensors(rest, {}, dtype)[0].items()
                               if not (k.startswith(counted) if single else k in counted)
                               and not (denoiser and k in DENOISERS)})
        elif single:
            notes.append("no config= given: only the file's own tensors are counted; the loader adds the "
                         "pipeline's other components (text encoders, VAE) from the model's config, which this "
                         "does not count: give SPEC,config=FOLDER to count them")
        else:
            notes.append("no base= given: only the GGUF transformer is counted, not the rest of the pipeline")
        return components, notes
    built = preset_folder(parsed.target) if parsed.kind == "random" else None
    if built is not None:
        return _folder(built, dtype), notes
    later = (" until its first load has built and saved it (then a restart sizes it from its folder)"
             if parsed.kind == "random" else "")
    raise WeightsError(f"{spec}: a model built in code ({parsed.kind}) has no files whose headers could be read"
                       f"{later}; fit sizes diffusers folders, hub ids in the HF cache, .safetensors and .gguf files")


def preset_folder(name: str) -> Path | None:
    """A ``random:`` preset's folder in the cache, where its first load (``save=1``, the default) saved it; None
    before that. Its headers size it as a folder's do, so ``offload=auto`` chooses for it from a budget instead of
    loading all of it (Wan 2.1 1.3B's 13.5 GiB under a 12 GiB budget: issue 28)."""
    folder = cache_root() / "models" / folder_name(get_preset(name))
    return folder if is_complete(folder) else None


def gguf_tensors(path: Path) -> list[Tensor]:
    return [Tensor(t.name, STORED_BF16 if t.kind == "BF16" else t.kind, t.nbytes, t.elements)
            for t in read_gguf(path).values()]


def _safetensors(path: Path) -> list[Tensor]:
    return [Tensor(name, kind, nbytes, nbytes * 8 // DTYPE_BITS[kind], dims)
            for name, (kind, nbytes, dims) in read_tensors(path).items()]


def _folder(path: Path, dtype: str) -> dict[str, list[Tensor]]:
    index = path / "model_index.json"
    if not index.is_file():  # one component's folder
        return {path.name: [t for f in component_files(path, dtype) for t in _safetensors(f.path)]}
    components = {}
    for sub in sorted(p for p in path.iterdir() if p.is_dir() and p.name not in NOT_LOADED):  # the loader skips them
        files = component_files(sub, dtype)
        if files:
            components[sub.name] = [t for f in files for t in _safetensors(f.path)]
    if not components:
        raise WeightsError(f"{path}: a diffusers folder without any .safetensors weights in its components")
    return components


def _checkpoint(path: Path) -> dict[str, list[Tensor]]:
    components: dict[str, list[Tensor]] = {}
    for t in _safetensors(path):
        prefix, where = next(((p, c) for p, c in _CHECKPOINT_PREFIXES if t.name.startswith(p)), ("", "transformer"))
        # the prefix stripped, so that ``double_blocks.N.`` groups as a block list as in a diffusers folder
        components.setdefault(where, []).append(replace(t, name=t.name.removeprefix(prefix)))
    return components


def hub_folder(repo_id: str) -> Path:
    from huggingface_hub import try_to_load_from_cache

    index = try_to_load_from_cache(repo_id, "model_index.json")
    if not isinstance(index, str):
        raise WeightsError(f"{repo_id} is not in the Hugging Face cache; download it first (`hf download {repo_id}`)")
    return Path(index).parent


def _by(tensors: Iterable[Tensor], key: str, dtype: str) -> dict[str, int]:
    """Bytes per block (``key="block"``: ``name.N`` of a direct child list, the rest under "") or per leaf
    module (``key="leaf"``: the name less its last part)."""
    out: dict[str, int] = {}
    for t in tensors:
        if key == "block":
            m = _BLOCK.match(t.name)
            group = f"{m.group(1)}.{m.group(2)}" if m else ""
        else:
            group = t.name.rsplit(".", 1)[0]
        out[group] = out.get(group, 0) + t.bytes_at(dtype)
    return out


def group_bytes(component: str, tensors: list[Tensor], dtype: str) -> int:
    """What group offloading keeps of one component on the device (the module docstring's rule)."""
    if component in DENOISERS:
        blocks = _by(tensors, "block", dtype)
        always = blocks.pop("", 0)
        return always + 2 * max(blocks.values(), default=0)
    return 2 * max(_by(tensors, "leaf", dtype).values(), default=0)


def configurations(components: Mapping[str, list[Tensor]], dtype: str, *, budget: int | None = None,
                   working: int | None = None, shape: Shape | None = None, on_cpu: bool = False,
                   approximations: tuple[str, ...] = ()) -> tuple[Configuration, ...]:
    """Every configuration, fastest first, with what it needs; ``fits`` against ``budget`` when one is given.
    ``working`` replaces the working-memory estimate (0: weights only). On a CPU there is nothing to offload
    to, so only the resident configurations are listed. ``approximations`` (``spec_approximations``) hold
    for every configuration: the model's options make them whichever way it fits."""
    if dtype not in TARGET_BYTES:
        raise WeightsError(f"dtype {dtype!r} is not one of {', '.join(TARGET_BYTES)}")
    shape = shape or Shape(1024, 1024)
    at = {name: sum(t.bytes_at(dtype) for t in ts) for name, ts in components.items()}
    total = sum(at.values())
    quantized = sorted({t.kind for ts in components.values() for t in ts if _gguf_quantized(t)})
    base_approx = tuple(f"gguf-{k}" for k in quantized if k != STORED_BF16)
    denoiser = next((c for c in DENOISERS if c in components), None)
    rows: list[tuple[str, str, int, int, tuple[str, ...], str]] = [
        ("none", "offload=none", total, 0, base_approx, "everything resident")]
    # fp8=rowwise: refused beside fp8 storage of its denoiser, offload=stream and offload=sequential (spec.py)
    rows8 = denoiser is not None and any(t.kind == "fp8-rowwise" for t in components[denoiser])
    if denoiser and not quantized and not rows8:
        floats = [t for t in components[denoiser] if t.kind in FLOATS]
        fp8 = total - sum(t.bytes_at(dtype) for t in floats) + sum(t.elements for t in floats)
        rows.append(("fp8", f"quant={denoiser}:fp8-storage", fp8, 0, (f"fp8-storage({denoiser}, computed in {dtype})",),
                     f"{denoiser}'s weights stored at 1 byte per parameter and cast to {dtype} per layer (norms "
                     f"and embeddings stay at {dtype}: a few % more); any device, no extra package"))
    if not on_cpu:
        group = max((group_bytes(c, ts, dtype) for c, ts in components.items()), default=0)
        leaf = max((max(_by(ts, "leaf", dtype).values(), default=0) for ts in components.values()), default=0)
        rows += [
            ("group", "offload=group", min(group, total), total, base_approx,
             "denoiser one block per group, other components one layer per group, next group prefetched on a "
             "CUDA stream"),
            ("model", "offload=model", max(at.values(), default=0), total, base_approx,
             f"one component at a time (the largest: {max(at, key=lambda k: at[k]) if at else '-'})"),
            ("sequential", "offload=sequential", leaf, total, base_approx, "one layer at a time (slowest)"),
        ][:2 if rows8 else 3]
    out = []
    for name, option, device, host, approx, note in rows:
        work = default_working(device, shape) if working is None else working
        fits = None if budget is None else device + work <= budget
        out.append(Configuration(name, option, device, host, work, approx + approximations, fits, note))
    streamed = None if on_cpu or quantized or rows8 else stream_configuration(components, dtype, budget=budget,
                                                                     working=working, shape=shape)
    if streamed is not None:
        out.insert(len([c for c in out if c.name in ("none", "fp8")]),
                   replace(streamed[0], approximations=approximations))
    return tuple(out)


def stream_inputs(components: Mapping[str, list[Tensor]], dtype: str,
                  ) -> tuple[dict[str, list[int]], int, int] | None:
    """The denoiser's blocks (``LIST.INDEX`` -> its tensors' bytes), its bytes outside them, and the largest
    other component's leaf-level group figure: ``stream_plan``'s inputs, as the worker takes them from the
    loaded modules (``offload.stream_sizes``). None without a denoiser made of lists of blocks."""
    denoiser = next((c for c in DENOISERS if c in components), None)
    if denoiser is None:
        return None
    blocks: dict[str, list[int]] = {}
    always = 0
    for t in components[denoiser]:
        m = _BLOCK.match(t.name)
        if m:
            blocks.setdefault(f"{m.group(1)}.{m.group(2)}", []).append(t.bytes_at(dtype))
        else:
            always += t.bytes_at(dtype)
    if not blocks:
        return None
    others = max((group_bytes(c, ts, dtype) for c, ts in components.items() if c != denoiser), default=0)
    return blocks, always, others


def stream_configuration(components: Mapping[str, list[Tensor]], dtype: str, *, budget: int | None,
                         working: int | None = None, shape: Shape | None = None,
                         ) -> tuple[Configuration, stream_plan.StreamPlan] | None:
    """``offload=stream`` with the most resident blocks that fit ``budget`` (none without a budget), and its
    plan; None when the model has no denoiser of block lists to stream."""
    inputs = stream_inputs(components, dtype)
    if inputs is None:
        return None
    shape = shape or Shape(1024, 1024)

    def work(device: int) -> int:
        return default_working(device, shape) if working is None else working

    blocks, always, others = inputs
    if budget is None:
        plan, fits = stream_plan.least(blocks, always, others), None
    else:
        plan, fits = stream_plan.choose(blocks, always, others, lambda device: device + work(device) <= budget)
    total = sum(t.bytes_at(dtype) for ts in components.values() for t in ts)
    host = total - plan.always - plan.resident
    note = plan.describe() + ("" if budget is not None else "; without a budget, the least it runs with: the "
                              "daemon keeps as many resident as --device-memory has room for")
    row = Configuration("stream", "offload=stream", plan.device_bytes, host, work(plan.device_bytes), (), fits, note,
                        plan.resident_blocks, plan.blocks)
    return row, plan


def fit(spec: str, *, dtype: str = "bfloat16", budget: int | None = None, working: int | None = None,
        options: Mapping[str, str] | None = None, on_cpu: bool = False, shape: Shape | None = None) -> FitReport:
    """``diffusiond fit``: the model's configurations from its headers, fastest first, without those its own
    options would refuse to load (the command and ``offload=auto`` alike)."""
    components, notes = model_tensors(spec, options, dtype)
    rows = configurations(components, dtype, budget=budget, working=working, on_cpu=on_cpu, shape=shape,
                          approximations=spec_approximations(spec, options, dtype))
    parsed = parse_spec(spec)
    opts = {**parsed.options, **(options or {})}
    rows = tuple(c for c in rows if not refused(c.name, opts, gguf=parsed.kind == "gguf"))
    at = {name: sum(t.bytes_at(dtype) for t in ts) for name, ts in components.items()}
    pipeline = skipped.pipeline_of(parsed.kind, _index_folder(parsed), opts, components)
    return FitReport(spec, dtype, budget, at, rows, tuple(notes), auto_skips=skipped.skips(pipeline))


def pipeline_class(spec: str, options: Mapping[str, str], dtype: str) -> str | None:
    """The pipeline class the loader builds for ``spec`` (``auto_skips.pipeline_of``); None where unknown."""
    try:
        parsed = parse_spec(spec)
        tensors = model_tensors(spec, options, dtype)[0] if parsed.kind == "checkpoint" else {}
        return skipped.pipeline_of(parsed.kind, _index_folder(parsed), {**parsed.options, **options}, tensors)
    except (WeightsError, PipelineError, OSError):
        return None


def _index_folder(parsed: ModelSpec) -> Path | None:
    """The folder whose ``model_index.json`` names the spec's pipeline (``_files`` read its weights there)."""
    if parsed.kind in ("random", "hub"):
        return preset_folder(parsed.target) if parsed.kind == "random" else hub_folder(parsed.target)
    return Path(parsed.target) if parsed.kind == "folder" else None


def plan_stream(spec: str, options: Mapping[str, str], dtype: str, budget: int,
                ) -> tuple[stream_plan.StreamPlan, Configuration]:
    """``offload=stream`` at the daemon's start: how many blocks stay resident within ``budget`` (the working
    memory estimated as ``fit`` does), from the files' headers. The row says whether even none fits."""
    components, _ = model_tensors(spec, options, dtype)
    if any(_gguf_quantized(t) for ts in components.values() for t in ts):
        raise PipelineError(f"{spec}: offload=stream is refused for a quantized (GGUF) denoiser, whose tensors are "
                            "not plain ones a slot can hold; use offload=group")
    got = stream_configuration(components, dtype, budget=budget)
    if got is None:
        raise PipelineError(f"{spec}: offload=stream streams the blocks of a transformer or unet made of lists of "
                            "blocks, and this model has none; use offload=group or model")
    row, plan = got
    return plan, row


def choose_offload(report: FitReport) -> tuple[str, str]:
    """``offload=auto``: the fastest exact configuration that fits (fp8 is never chosen for the user: it
    changes outputs), and why. Nothing fitting gives ``sequential``, the least on the device, and a reason
    naming every configuration and what it needed: residency then refuses the model's jobs as too large. A
    stream plan with too few blocks resident is passed over (``auto_skips.too_few_resident``)."""
    exact = [c for c in report.configurations
             if c.name not in report.auto_skips and not skipped.too_few_resident(c.resident_blocks, c.blocks)]
    if report.budget is None:
        return "none", "no --device-memory budget: everything stays resident"
    for c in exact:
        if c.fits:
            return c.name, (f"{c.name} at {report.dtype}: needs {format_bytes(c.needs)} of the "
                            f"{format_bytes(report.budget)} budget")
    least = exact[-1].name if exact else "none"
    return least, (f"{least} at {report.dtype}, though nothing fits the budget of {format_bytes(report.budget)}: "
                   f"{tried(report)}")


def tried(report: FitReport) -> str:
    """Every configuration and what it needed, for an error a user acts on."""
    return "; ".join(f"{c.name} ({c.option}) needs {format_bytes(c.needs)} on the device"
                     for c in report.configurations)


def choose_auto(spec: str, options: Mapping[str, str], dtype: str, *, on_cpu: bool, budget: int | None,
                skips: Mapping[str, str] | None = None) -> tuple[str, str, str]:
    """What ``offload=auto`` runs a configured model with, why (logged at the daemon's start), and, when no
    configuration fits the budget, the message its jobs are refused with (``model_too_large``): every
    configuration tried and what it needed. Empty when one fits, or when the model cannot be sized. ``skips``:
    more configurations to pass over for this start, and why (model_config.resolve_offload's)."""
    if on_cpu:
        return "none", "none: a CPU device holds the weights in host memory already", ""
    if budget is None:
        return "none", "none: no --device-memory budget to fit", ""
    try:
        report = fit(spec, dtype=dtype, budget=budget, options=options)
        report = replace(report, auto_skips={**report.auto_skips, **(skips or {})})
    except (WeightsError, PipelineError) as exc:
        return "none", f"none: the model's size is not known before it loads ({exc})", ""
    chosen, why = choose_offload(report)
    skips = report.auto_skips
    if any(c.fits for c in report.configurations if c.name not in skips):
        return chosen, why, ""
    hint = "".join(f"; {c.option} ({skips[c.name]}) would fit: ask for it" for c in report.configurations
                   if c.name in skips and c.fits)
    return chosen, why, (f"nothing fits the --device-memory budget of {format_bytes(budget)} with offload=auto: "
                         f"{tried(report)}{hint}")


def device_weights(spec: str, options: Mapping[str, str], dtype: str, *, on_cpu: bool) -> int | None:
    """What a configured model keeps on its device, from its files' headers: residency places it with this
    before its first load, so one larger than the budget is refused at admission with the numbers instead
    of loaded to learn its size (the worker's count replaces it at READY). The row of the model's offload
    (made concrete at start, ``model_config.resolve_offload``); for ``offload=stream``, its plan at the
    ``resident_blocks`` chosen then, a hub id's and a saved preset's too: that plan fills the budget, so a first
    load unplaced could run out beside a resident model. None where the files
    cannot tell: a hub id or preset under another offload (sized by its first load), a model built in code."""
    try:
        parsed = parse_spec(spec)
        mode = "none" if on_cpu else offload_mode({**parsed.options, **options})
        if mode == "stream" and parsed.kind in ("folder", "checkpoint", "hub", "random"):
            return _stream_bytes(spec, options, dtype)
        if parsed.kind not in ("folder", "checkpoint", "gguf"):
            return None
        report = fit(spec, dtype=dtype, working=0, options=options, on_cpu=on_cpu)
    except (WeightsError, PipelineError, OSError):
        return None
    return next((c.device_bytes for c in report.configurations if c.name == mode), None)


def _stream_bytes(spec: str, options: Mapping[str, str], dtype: str) -> int | None:
    """An ``offload=stream`` model's device figure for its ``resident_blocks`` (None without one)."""
    count = resident_blocks({**parse_spec(spec).options, **options})
    inputs = stream_inputs(model_tensors(spec, options, dtype)[0], dtype)
    if count is None or inputs is None:
        return None
    return stream_plan.plan(*inputs, min(count, len(inputs[0]))).device_bytes
