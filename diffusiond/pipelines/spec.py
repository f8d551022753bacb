"""Model specs: the one grammar in which a config file, a CLI flag and a worker name a model.

The daemon reads specs long before any worker loads one (``--model NAME=SPEC``, the short model
name clients use), and the registry reads them again to load; both go through this module so the
two can never disagree. It imports neither torch nor diffusers, so the config and the CLI stay
fast to start.

Grammar::

    arg     := SPEC | NAME "=" SPEC          (NAME has no "/", ":" or ",")
    SPEC    := "synthetic" [":" OPTIONS]
             | "random:" PRESET ["," OPTIONS]
             | FILE.gguf ",base=" (FOLDER | ORG/NAME) ["," OPTIONS]   (a GGUF transformer; the rest from the base;
                                                     Wan 2.2 A14B's second expert: OPTIONS' transformer_2=LOW.gguf)
             | MODEL ["," OPTIONS]
    MODEL   := "tiny" | "tiny-inpaint" | "tiny-video" | "tiny-flux" | FOLDER | FILE.safetensors | ORG/NAME (hub id)
    OPTIONS := KEY "=" VALUE ("," KEY "=" VALUE)*   (``quant``'s value may hold commas: parse_options)

A folder whose own name holds a comma is still that folder: the whole spec is tried as a path first.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Literal

from diffusiond.pipelines.attention import check_attention
from diffusiond.pipelines.denoisers import DENOISERS
from diffusiond.pipelines.errors import PipelineError
from diffusiond.pipelines.preset_tables import get_preset

# Every option any loader understands; others are refused so a typo does not pass silently.
KNOWN_OPTIONS = frozenset(
    {
        "allow_unsafe_weights",  # "1": allow pickle-based weights (.bin) when no safetensors exist
        "cpu_offload",  # "1": enable_model_cpu_offload (accelerator devices only); the same as offload=model
        "offload",  # none|model|group|sequential|stream|auto: what stays on the device (pipelines/offload.py)
        "resident_blocks",  # offload=stream: denoiser blocks kept on the device (else planned from the budget)
        "base",  # a .gguf transformer: the diffusers folder or hub id with the rest of the pipeline
        "transformer_2",  # a .gguf transformer: Wan 2.2 A14B's low-noise expert, a .gguf file of its own
        "vae_tiling",  # "1": decode large images in tiles
        "vae_slicing",  # "1": decode a batch one image at a time
        "preview_decoder",  # a diffusers AutoencoderTiny folder for previews (else the family's factors)
        "pipeline_class",  # single-file checkpoints: diffusers class to load it with
        "config",  # single-file checkpoints: local diffusers folder or hub id with the configs
        "local_files_only",  # "1": hub ids: never touch the network, only the HF cache
        "compute_ms",  # synthetic: device work per batch
        "task",  # synthetic: "image" or "video"
        "matrix",  # synthetic: side of the square matrices of the workload
        "save",  # random:<preset>: "0" builds on the device and skips the save/load round trip
        "cache",  # approximate: "fbc[:threshold]" or "taylorseer[:interval]" (pipelines/speedups.py)
        "attention",  # the denoiser's attention kernel, a diffusers dispatch backend (pipelines/attention.py)
        "fp8",  # approximate: "1" (torchao) or "rowwise": fp8 denoiser matmuls (pipelines/speedups.py)
        "quant",  # approximate: COMPONENT:METHOD,... weights in fewer bits per component (pipelines/quant.py)
        "compile_backend",  # --compile: torch.compile backend (default inductor; aot_eager for CPU tests)
        "compile_shapes",  # --compile: at most this many shapes compiled per module (default 8)
        "fuse_qkv",  # --compile: "1": fuse the attention QKV projections
        "channels_last",  # --compile: "1": channels_last memory format for the UNet and the VAE decoder
        "compile_encoders",  # --compile: "1"|"0": compile the text encoders or not (compile_rules.left_eager)
    }
)
ACCEPTED_FORMS = (
    "'tiny', 'tiny-inpaint', 'tiny-video' or 'tiny-flux' (embedded random-weight models, no download), "
    "'random:<preset>' (a real architecture at full size with random weights, for benchmarks: "
    "random:sd15, random:sdxl, random:flux-dev, random:flux-kontext, random:wan-1.3b, random:sd3.5-medium, "
    "random:sd3.5-large, random:wan2.2-5b, random:ltx-2b, random:ltx-2, random:qwen-image, "
    "random:qwen-image-edit, random:qwen-image-edit-plus), "
    "'synthetic' or 'synthetic:compute_ms=40,task=video' (no diffusers, for benchmarks), "
    "a local folder with a diffusers model_index.json, "
    "a path to a single-file '.safetensors' checkpoint, "
    "a '.gguf' transformer with option base=<diffusers folder or hub id> for the rest of the pipeline, "
    "or a Hugging Face hub id 'org/name' already in the HF cache"
)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_PICKLE_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin")

Kind = Literal["synthetic", "tiny", "tiny-inpaint", "tiny-video", "tiny-flux", "random", "folder", "checkpoint", "gguf",
               "hub"]
OFFLOAD_MODES = ("none", "model", "group", "sequential", "stream", "auto")
MAX_RESIDENT_BLOCKS = 100_000  # far above any model's (FLUX.1-dev has 57); a bound so a typo is not a huge int


@dataclass(frozen=True)
class ModelSpec:
    """A spec read but not loaded: which loader takes it, and what it names."""

    kind: Kind
    # The preset name for ``random``, the (user-expanded) path for ``folder`` and ``checkpoint``,
    # the hub id for ``hub``; the spec itself otherwise.
    target: str
    # Options written inside the spec (``synthetic:k=v``, ``random:preset,k=v``); options given
    # beside the spec (config ``options``) take precedence over these.
    options: Mapping[str, str] = field(default_factory=dict)


def parse_options(text: str, spec: str) -> dict[str, str]:
    """``k=v,k=v`` pairs; a malformed pair is an error, never ignored, so a typo is seen at start."""
    options: dict[str, str] = {}
    last = ""
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep and last == "quant" and ":" in part:  # quant=transformer:nf4,text_encoder_2:int8
            options["quant"] += "," + part
            continue
        last = key.strip()
        if not sep or not key.strip():
            raise PipelineError(f"bad option {part!r} in model spec {spec!r}; expected key=value pairs")
        options[key.strip()] = value.strip()
    return options


# quant=COMPONENT:METHOD,...: the grammar lives here, torch-free, so the engine checks it at start (and
# offload=stream's refusals read it); pipelines/quant.py applies the methods.
POST_LOAD: Final = ("fp8-storage", "int8", "fp8")
"""Applied to the loaded component before it is moved to its device, so that only the smaller weights
ever reach it (a model chosen because it does not fit in full precision must not pass through it)."""
AT_LOAD: Final = ("nf4", "fp4", "bnb8")
"""Applied while the component is read from its files (bitsandbytes)."""
METHODS: Final = (*POST_LOAD, *AT_LOAD)
_COMPONENT: Final = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")


def parse_quant(text: str) -> dict[str, str]:
    """``transformer:nf4,text_encoder_2:int8`` -> {component: method}; every fault is named with the value."""
    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        component, sep, method = (s.strip() for s in part.partition(":"))
        if not sep or not _COMPONENT.match(component):
            raise PipelineError(f"quant: {part!r} is not COMPONENT:METHOD (for example transformer:fp8-storage)")
        if method not in METHODS:
            raise PipelineError(f"quant: {component}:{method} is not a method; known: {', '.join(METHODS)}")
        if component in out:
            raise PipelineError(f"quant: {component} is given twice ({out[component]} and {method}); keep one")
        out[component] = method
    if not out:
        raise PipelineError("quant: empty; give COMPONENT:METHOD pairs, for example quant=transformer:fp8-storage")
    return out


def check_options(options: Mapping[str, str]) -> None:
    """Refuse options no loader reads: a misspelt ``cpu_ofload=1`` must not load silently without it."""
    unknown = sorted(set(options) - KNOWN_OPTIONS)
    if unknown:
        raise PipelineError(f"unknown model option(s) {', '.join(unknown)}; known: {', '.join(sorted(KNOWN_OPTIONS))}")
    offload_mode(options)
    if options.get("attention"):
        check_attention(options["attention"])
    if "quant" in options:
        parse_quant(options["quant"])
    encoders = options.get("compile_encoders", "")
    if encoders not in ("", "0", "1"):
        raise PipelineError(f"compile_encoders={encoders[:40]!r}: give 1 (compile the text encoders with --compile) "
                            "or 0 (leave them eager), or leave it out (eager beside a transformer, else compiled)")
    _fp8_refusals(options)


FP8_VALUES: Final = ("", "0", "1", "rowwise")
FP8_ROWS_NAME: Final = "fp8-rowwise(weights and activations in fp8, scaled per row)"
"""How ``fp8=rowwise`` is named in every output's ``approximations`` and by ``fit``."""
FP8_ROWS_KEEP: Final = ("pos_embed", "patch_embed", "norm", "^proj_in$", "^proj_out$", "embed")
"""The modules ``fp8=rowwise`` leaves as loaded, by name (``re.search``), for the load (pipelines/fp8_rows.py) and
``fit`` alike: diffusers' skip list for fp8 storage, and the embedders: the first projection
(FLUX's x_embedder) and the timestep and text embedders are small or run once a step, so converting them would
round for little speed."""


def fp8_rows_kept(module: str) -> bool:
    """Whether ``fp8=rowwise`` leaves the module of this dotted name as loaded (``FP8_ROWS_KEEP``)."""
    return any(re.search(p, module) for p in FP8_ROWS_KEEP)


def _fp8_refusals(options: Mapping[str, str]) -> None:
    """What ``fp8=`` cannot combine with, refused at start: each would load and then fail on
    the first job, or be named on every output while changing nothing."""
    fp8 = options.get("fp8", "")
    if fp8 not in FP8_VALUES:
        raise PipelineError(f"fp8={fp8!r}: use fp8=1 (torchao) or fp8=rowwise (diffusiond's own, no extra package)")
    if fp8 not in ("1", "rowwise"):
        return
    named = parse_quant(options["quant"]) if options.get("quant") else {}
    for denoiser in DENOISERS:
        if denoiser in named:
            raise PipelineError(f"fp8={fp8} with quant={denoiser}:{named[denoiser]} is refused: the {denoiser} is "
                                "quantized already, so fp8 would find no plain layer to convert; keep one of the two")
    if fp8 == "rowwise" and options.get("fuse_qkv") == "1":
        raise PipelineError("fp8=rowwise with fuse_qkv=1 is refused: fp8=rowwise fuses the QKV projections itself "
                            "before it quantizes them, where the model's attention can; drop fuse_qkv=1")
    if fp8 == "1" and offload_mode(options) in ("group", "sequential"):
        raise PipelineError(f"fp8=1 with offload={offload_mode(options)} is refused: torchao swaps each linear layer's "
                            "weight after the offload's hooks are made, and the hooks would go on moving the old "
                            "weights; use fp8=rowwise (applied before the hooks) or offload=model, or drop one")
    if fp8 == "rowwise" and offload_mode(options) == "sequential":
        raise PipelineError("fp8=rowwise with offload=sequential is refused: accelerate keeps each layer's "
                            "weights in its own hooks, which the fp8 layers do not carry; use offload=group or model")


def offload_mode(options: Mapping[str, str]) -> str:
    """The ``offload`` option, with ``cpu_offload=1`` read as its older name for ``offload=model``; a value
    outside OFFLOAD_MODES, or the two options disagreeing, is refused rather than one silently winning."""
    mode = options.get("offload", "")
    if mode and mode not in OFFLOAD_MODES:
        raise PipelineError(f"offload={mode!r} is not one of {', '.join(OFFLOAD_MODES)}")
    legacy = options.get("cpu_offload", "")
    if legacy not in ("", "0", "1"):
        raise PipelineError(f"cpu_offload={legacy!r}: use 1 (the same as offload=model) or 0")
    if legacy == "1":
        if mode not in ("", "model"):
            raise PipelineError(f"cpu_offload=1 means offload=model, but offload={mode} is given too; keep one")
        mode = "model"
    mode = mode or "none"
    if resident_blocks(options) is not None and mode != "stream":
        given = f"offload={mode} is given" if options.get("offload") or legacy == "1" else "no offload is given"
        raise PipelineError(f"resident_blocks={options['resident_blocks']} applies to offload=stream only, and "
                            f"{given}; add offload=stream or drop resident_blocks")
    if mode == "stream":
        _stream_refusals(options)
    return mode


DEFAULT_COMPILE_SHAPES = 8  # dynamo's own recompile limit


def compile_shapes(options: Mapping[str, str]) -> int:
    """``compile_shapes=N``: the graphs (shapes) a compiled module keeps; read here, without torch, because
    the engine holds ``--warmup`` to it at start and the worker bounds its compiles by it."""
    text = options.get("compile_shapes")
    if text is None:
        return DEFAULT_COMPILE_SHAPES
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise PipelineError(f"compile_shapes={text[:40]!r} is not a whole number of at least 1; give the most "
                            f"shapes a compiled module may keep (default {DEFAULT_COMPILE_SHAPES})")
    return int(text)


def resident_blocks(options: Mapping[str, str]) -> int | None:
    """``resident_blocks=N`` (offload=stream's denoiser blocks kept on the device), checked; None if absent."""
    text = options.get("resident_blocks")
    if text is None:
        return None
    if not (text.isascii() and text.isdigit()) or int(text) > MAX_RESIDENT_BLOCKS:
        raise PipelineError(f"resident_blocks={text[:40]!r}: give a whole number of blocks from 0 (stream them "
                            f"all) up to the denoiser's block count, or leave it out to have the daemon choose")
    return int(text)


def _stream_refusals(options: Mapping[str, str]) -> None:
    """What offload=stream cannot carry: weights that are not plain tensors or that other hooks move."""
    if options.get("fp8") in ("1", "rowwise"):
        raise PipelineError(f"offload=stream with fp8={options['fp8']} is refused: a block's slots are made for "
                            "the model's own weights, not float8 ones with their scales; drop one of the two")
    named = parse_quant(options["quant"]) if options.get("quant") else {}
    for denoiser in ("transformer", "unet"):
        if denoiser in named:
            raise PipelineError(f"offload=stream with quant={denoiser}:... is refused: a quantized {denoiser}'s "
                                "weights are cast or packed by their own hooks, which streaming cannot carry; "
                                f"quantize the other components only, or use offload=group")


def model_options(spec: str, options: Mapping[str, str] | None = None) -> dict[str, str]:
    """A model's options: those written in its spec (``tiny,fuse_qkv=1``) under those given beside it
    (a ``[[models]]`` table's ``options``). Whatever reads an option after the load (the compile, the
    engine's checks) reads this, so that an option never works in one of the two places only."""
    return {**parse_spec(spec).options, **(options or {})}


def parse_spec(spec: str) -> ModelSpec:
    """Which loader takes ``spec``; resolution is ordered, so a folder named like a hub id is a folder.

    Reads the file system (is it a folder?) but loads nothing. A spec no loader takes is an error
    listing every accepted form.
    """
    spec = spec.strip()
    if spec == "synthetic" or spec.startswith("synthetic:"):
        return ModelSpec("synthetic", spec, parse_options(spec.partition(":")[2], spec))
    head, sep, rest = spec.partition(",")
    if sep and not spec.startswith("random:") and not head.lower().endswith(".gguf") \
            and not Path(spec).expanduser().exists():  # MODEL,OPTIONS: tiny,quant=unet:fp8-storage
        inner = parse_spec(head)
        return ModelSpec(inner.kind, inner.target, {**inner.options, **parse_options(rest, spec)})
    if spec == "tiny":
        return ModelSpec("tiny", spec)
    if spec == "tiny-video":
        return ModelSpec("tiny-video", spec)
    if spec == "tiny-inpaint":
        return ModelSpec("tiny-inpaint", spec)
    if spec == "tiny-flux":
        return ModelSpec("tiny-flux", spec)
    if spec.startswith("random:"):
        key, _, rest = spec.removeprefix("random:").partition(",")  # random:wan-1.3b,save=0
        return ModelSpec("random", key, parse_options(rest, spec))
    if not spec:
        raise PipelineError(f"empty model spec; accepted: {ACCEPTED_FORMS}")
    path = Path(spec).expanduser()
    if path.is_dir():
        return ModelSpec("folder", str(path))
    lower = spec.lower()
    if lower.endswith(".safetensors"):
        return ModelSpec("checkpoint", str(path))
    head, sep, rest = spec.partition(",")  # flux-Q8_0.gguf,base=/models/flux-dev
    if head.lower().endswith(".gguf"):
        return ModelSpec("gguf", str(Path(head).expanduser()), parse_options(rest, spec) if sep else {})
    if lower.endswith(_PICKLE_SUFFIXES):
        raise PipelineError(
            f"{spec!r} is a pickle-based checkpoint; diffusiond loads only safetensors "
            "(convert it, or use a diffusers folder)"
        )
    if path.is_file():  # /etc/passwd: there, but no model file; "does not exist" would send the user looking
        raise PipelineError(not_a_model_file(spec, "diffusiond can load"))
    if _HUB_ID.match(spec):
        return ModelSpec("hub", spec)
    if spec.startswith(("/", "./", "../", "~")):  # a path, never a hub id: say what is wrong with it
        raise PipelineError(f"{spec} does not exist; {_WHAT_TO_GIVE}")
    raise PipelineError(f"unrecognised model spec {spec!r}; accepted: {ACCEPTED_FORMS}")


_WHAT_TO_GIVE = ("give a diffusers folder (with model_index.json), a .safetensors or .gguf file, "
                 "a hub id already in the Hugging Face cache, or tiny")


def not_a_model_file(spec: str, who: str) -> str:
    """What a file that exists but holds no model is told (``serve --model /etc/passwd``, ``fit
    /etc/passwd``): ``who`` names the command that cannot take it, the rest is the same for every command."""
    return (f"{spec}: a file, but not one {who}: give a .safetensors or .gguf file, a diffusers folder "
            "(with model_index.json) or a hub id in the Hugging Face cache")


def check_spec(spec: str, options: Mapping[str, str] | None = None) -> None:
    """What can be known of a spec before any worker starts, without torch and without the network.

    Called by the daemon's configuration, so a missing folder, file or uncached hub id is one clear
    line and exit 2 before the start, instead of a worker's traceback per attempt (the loaders
    raise the same errors later; this only moves them forward). The hub cache is read with
    ``try_to_load_from_cache``, which looks at the cache folder and never at the network. ``options``: those
    given beside the spec (a ``[[models]]`` table's), checked with its own as the loaders merge them.
    """
    parsed = parse_spec(spec)
    opts = model_options(spec, options)
    check_options(opts)
    if parsed.kind == "random":
        get_preset(parsed.target)  # an unknown name: the list of presets
    if parsed.kind in ("checkpoint", "gguf") and not Path(parsed.target).is_file():
        raise PipelineError(f"{parsed.target} does not exist; {_WHAT_TO_GIVE}")
    if parsed.kind == "gguf" and opts.get("fp8") in ("1", "rowwise"):  # at start, not per job
        raise PipelineError(f"fp8={opts['fp8']} with a GGUF transformer is refused: its layers are quantized "
                            "already, so fp8 would find no plain layer to convert; drop fp8 or load the model "
                            "from its folder")
    if parsed.kind == "gguf" and opts.get("base"):
        check_spec(opts["base"])
    check_second_expert(parsed.kind, opts)
    if parsed.kind == "gguf" and opts.get("transformer_2") and opts.get("base"):
        index = _base_index(opts["base"])
        if index is not None and (refusal := second_expert_refusal(opts, index)):
            raise PipelineError(refusal)
    if parsed.kind == "hub" and not _hub_cached(parsed.target):
        raise PipelineError(
            f"{parsed.target} is neither a folder nor a hub id in the Hugging Face cache; download it first "
            f"(`hf download {parsed.target}`, older hubs: `huggingface-cli download {parsed.target}`), "
            "or give a diffusers folder (with model_index.json), a .safetensors file, or tiny")


def check_second_expert(kind: Kind, options: Mapping[str, str]) -> None:
    """``transformer_2=FILE.gguf`` is a GGUF spec's (issue 28): beside a folder it would be ignored, and a path
    that is no GGUF file would fail only at load, in a worker."""
    value = options.get("transformer_2")
    if value is None:
        return
    if kind != "gguf":
        raise PipelineError(f"transformer_2={value}: the option names the second expert's GGUF file of a GGUF spec "
                            "(HIGH.gguf,base=FOLDER,transformer_2=LOW.gguf); a folder or hub id loads its own "
                            "transformer_2: drop the option")
    path = Path(value).expanduser()
    if not value.lower().endswith(".gguf") or not path.is_file():
        raise PipelineError(f"transformer_2={value}: {'no such file' if not path.exists() else 'not a .gguf file'}; "
                            "give the low-noise expert's GGUF file (Wan2.2-T2V-A14B-LowNoise-Q8_0.gguf)")


def second_expert_refusal(options: Mapping[str, str], index: Mapping[str, object]) -> str | None:
    """Why ``transformer_2=`` cannot go with the base whose model_index.json is ``index``: it has no second
    expert for the file to replace (a Wan 2.1 or TI2V base). Read at start and again by the loader."""
    entry = index.get("transformer_2")
    if isinstance(entry, list) and len(entry) == 2 and entry[1]:
        return None
    return (f"transformer_2={options.get('transformer_2')}: base={options.get('base')} ({index.get('_class_name')}) "
            "has no transformer_2, the low-noise expert that file would replace (Wan 2.2 A14B's bases have one: "
            "Wan-AI/Wan2.2-T2V-A14B-Diffusers); drop transformer_2= or name an A14B pipeline as base=")


def _base_index(base: str) -> Mapping[str, object] | None:
    """A GGUF base's model_index.json, from its folder or the HF cache; None where it cannot be read here (the
    loader says why)."""
    try:
        parsed = parse_spec(base)
        if parsed.kind == "folder":
            path: object = Path(parsed.target) / "model_index.json"
        elif parsed.kind == "hub":
            from huggingface_hub import try_to_load_from_cache

            path = try_to_load_from_cache(parsed.target, "model_index.json")
        else:
            return None
        index = json.loads(Path(str(path)).read_text(encoding="utf-8")) if isinstance(path, (str, Path)) else None
    except (PipelineError, OSError, ValueError, ImportError):
        return None
    return index if isinstance(index, dict) else None


def _hub_cached(repo_id: str) -> bool:
    """Whether the HF cache holds the repo's model_index.json (HF_HOME and HF_HUB_CACHE respected).
    Without huggingface_hub the loaders could not read the hub anyway: nothing to say here then."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - a dependency of diffusers
        return True
    return isinstance(try_to_load_from_cache(repo_id, "model_index.json"), str)


def is_synthetic(spec: str) -> bool:
    """Whether the spec names a model whose outputs are not pictures of anything (random weights,
    or no model at all): clients are told, so nobody mistakes its noise for a result."""
    return spec.startswith(("synthetic", "random:"))


def loads_libraries(spec: str) -> bool:
    """Whether loading the spec imports diffusers' and transformers' models: every spec but ``synthetic`` (the
    random presets too, which are diffusers models; taken as synthetic here, their workers and the template skipped
    those imports and paid them inside the model's load, out of the template's reach)."""
    return not spec.startswith("synthetic")


def model_name_for(spec: str) -> str:
    """A short, stable name for a model spec: what clients put in ``"model"``."""
    if spec.startswith("synthetic"):
        return "synthetic"
    if spec.startswith("random:"):
        return spec
    head, sep, _ = spec.partition(",")
    if sep and ".gguf" not in head.lower() and not Path(spec).expanduser().exists():
        return model_name_for(head)  # MODEL,OPTIONS: named for the model
    p = Path(spec)
    if spec.endswith((".safetensors", ".ckpt")):
        return p.stem
    if ".gguf" in spec.lower():
        return Path(spec.partition(",")[0]).stem
    if p.is_dir() or spec.startswith(("/", ".", "~")):
        return p.name or spec
    return spec


def parse_model_arg(arg: str) -> tuple[str, str]:
    """``SPEC`` or ``NAME=SPEC`` -> (name, spec). A spec may itself hold ``=`` (``synthetic:compute_ms=40``):
    what precedes the first ``=`` is a name only if it has no ``/``, ``:`` or ``,``, which names never do."""
    name, sep, spec = arg.partition("=")
    if sep and name and not any(c in name for c in "/:,"):
        return name, spec
    return model_name_for(arg), arg
