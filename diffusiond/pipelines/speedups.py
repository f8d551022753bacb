"""Opt-in approximate speed-ups: outputs differ from the model's own, so each is named in every output.

- ``cache=fbc[:THRESHOLD]``: diffusers' First Block Cache (reuse the rest of the network's residual
  while the first block's output changes less than THRESHOLD, default 0.05). The change is measured over
  the whole batch tensor and the skip decided once per step for the batch, so a request's output depends
  on what it is batched with (tiny-flux, 8 steps, alone and in a batch of 4: 0.005 apart at threshold
  0.5, where a decision flips); its name says so. TaylorSeer predicts per element and has no such dependence;
- ``cache=taylorseer[:INTERVAL]``: diffusers' TaylorSeer cache (predict features between full steps
  every INTERVAL steps, default 5). It predicts the attention modules' outputs only, so every step still runs
  each block's feed-forward: 1.52x on FLUX.1-dev at 28 steps (H100, docs/benchmarks.md);
- ``cache=taylorseer-lite[:INTERVAL]``: its lite mode: between full steps the blocks are skipped whole and only
  the transformer's output projection is predicted, so a predicted step costs little more than the embeddings.
  Refused at load where that would be wrong: another output head (LTX-2's audio), no ``proj_out``, no blocks;
- ``fp8=1``: float8 weights and activations for the denoiser's linear layers through torchao, on
  GPUs with fp8 matrix units (compute capability 8.9+: Ada, Hopper). torchao is not a dependency:
  the option says so when it is missing;
- ``fp8=rowwise``: the same arithmetic without torchao, scaled per row, as plain tensors that compile
  (pipelines/fp8_rows.py says why it exists beside ``fp8=1``).

Each applies to every denoiser the pipeline has (both of Wan 2.2 A14B's experts: pipelines/denoisers.py).
Both cache hooks exist only on diffusers' transformer denoisers (``CacheMixin``: Flux, SD3, Wan,
LTX, ...); a UNet model (SD 1.5, SDXL) refuses the option at load, naming the reason, and so does a pipeline class
whose denoiser calls of one step would share one cache state (``_context_plan``: ChromaPipeline's CFG passes).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from diffusiond.pipelines.denoisers import denoisers
from diffusiond.pipelines.errors import PipelineError
from diffusiond.pipelines.spec import FP8_ROWS_NAME

__all__ = ["ONE_CALL_A_STEP", "apply_fp8_rows", "apply_speedups", "step_cache_context", "step_cache_refusal"]

log = logging.getLogger(__name__)


def _number(option: str, text: str, kind: type[float] | type[int]) -> float:
    try:
        value = kind(text)
    except ValueError:
        raise PipelineError(f"{option}: {text!r} is not a {'number' if kind is float else 'whole number'}") from None
    if value <= 0:
        raise PipelineError(f"{option}: must be positive, got {text}")
    return value


def _cache_config(value: str) -> tuple[Any, str]:
    import diffusers

    kind, _, arg = value.partition(":")
    if kind == "fbc":
        threshold = _number(f"cache={value}", arg, float) if arg else 0.05
        name = f"first-block-cache(threshold={threshold:g}, decided per batch)"  # see the module's docstring
        return diffusers.FirstBlockCacheConfig(threshold=threshold), name
    if kind in ("taylorseer", "taylorseer-lite"):
        interval = int(_number(f"cache={value}", arg, int)) if arg else 5
        lite = kind == "taylorseer-lite"
        return (diffusers.TaylorSeerCacheConfig(cache_interval=interval, use_lite_mode=lite),
                f"taylorseer-cache(interval={interval}{', lite: blocks skipped between full steps' if lite else ''})")
    raise PipelineError(f"cache={value!r}: known caches are fbc[:THRESHOLD], taylorseer[:INTERVAL] and "
                        "taylorseer-lite[:INTERVAL]")


def _fp8(denoiser: Any, device: torch.device) -> str:
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        raise PipelineError("fp8=1 needs a CUDA GPU with fp8 matrix units (compute capability 8.9+: Ada, Hopper)")
    try:
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, quantize_
    except ImportError as exc:
        raise PipelineError(f"fp8=1 needs the torchao package (pip install torchao): {exc}") from exc
    quantize_(denoiser, Float8DynamicActivationFloat8WeightConfig())
    return "fp8-weights-and-activations(torchao)"


def apply_fp8_rows(pipe: Any, options: Mapping[str, str], device: torch.device, resident: bool) -> tuple[str, ...]:
    """``fp8=rowwise``, applied while the model is still on the host, before any offload hooks are made and
    before the move: those hooks are made for the layers they find, and the device then holds
    fp8, never the full-precision denoiser (FLUX.1-dev's 24 GB would not load on a 24 GiB card). Each layer is
    quantized on ``device`` and left there when the model will be ``resident``, else back on the host."""
    if options.get("fp8") != "rowwise":
        return ()
    from diffusiond.pipelines.fp8_rows import check_device, check_plain, to_fp8_rowwise
    from diffusiond.pipelines.fusion import fuse_for_fp8

    found = denoisers(pipe)
    if not found:
        raise PipelineError(f"fp8=rowwise: {type(pipe).__name__} has no denoiser to quantize")
    check_device(device)
    for attr, denoiser in found:
        check_plain(denoiser, f"the model's {attr}")
    fused = fuse_for_fp8(pipe)
    layers = sum(to_fp8_rowwise(denoiser, device, f"the model's {attr}", resident) for attr, denoiser in found)
    log.info("fp8=rowwise: %d linear layers converted, the QKV projections of %d attentions fused", layers, fused)
    return (FP8_ROWS_NAME,)


def apply_speedups(pipe: Any, options: Mapping[str, str], device: torch.device) -> tuple[str, ...]:
    """Apply the approximate speed-ups ``options`` ask for; their names, for every output's metadata."""
    names: list[str] = []
    found = denoisers(pipe)  # Wan 2.2 A14B's two experts each run part of every job's steps
    if options.get("fp8") == "1":  # fp8=rowwise is applied before the offload and the move (apply_fp8_rows)
        if not found:
            raise PipelineError(f"fp8=1: {type(pipe).__name__} has no denoiser to quantize")
        names.extend(sorted({_fp8(denoiser, device) for _, denoiser in found}))
    cache = options.get("cache")
    if cache:
        from diffusers.models.cache_utils import CacheMixin

        for attr, denoiser in found or [("denoiser", None)]:
            if not isinstance(denoiser, CacheMixin):
                kind = type(denoiser).__name__
                raise PipelineError(
                    f"cache={cache}: the model's {attr} ({kind}) has no diffusers cache hooks; they exist on "
                    "some transformer models (Flux, Wan, LTX, Qwen-Image, ...), not on UNet models (SD 1.5, SDXL)"
                )
        if cache.partition(":")[0] == "taylorseer-lite":
            for attr, denoiser in found:
                why = _lite_misfit(denoiser)
                if why:
                    raise PipelineError(f"cache={cache}: the model's {attr} ({type(denoiser).__name__}) {why}; use "
                                        "cache=taylorseer, which predicts each attention module instead")
        if (refusal := step_cache_refusal(f"cache={cache}", pipe)) is not None:
            raise refusal  # before any hook, as the checks above
        name = _cache_config(cache)[1]
        for _, denoiser in found:
            denoiser.enable_cache(_cache_config(cache)[0])  # a config each: a hook keeps its state per module
        names.append(name)
    return tuple(names)


def _lite_misfit(denoiser: Any) -> str:
    """Why TaylorSeer's lite mode would give wrong outputs on ``denoiser`` ('' if it fits). Between full steps it
    skips every block (its output zeros) and predicts only ``proj_out``: an output head of another name (LTX-2's
    ``audio_proj_out``) would run on the zeros, and a model with no ``proj_out`` or no matching block would run
    uncached under the cache's name. The patterns are diffusers' own."""
    import re

    from diffusers.hooks.taylorseer_cache import _BLOCK_IDENTIFIERS, _PROJ_OUT_IDENTIFIERS

    heads = sorted(n for n, _ in denoiser.named_children() if n.endswith("proj_out"))
    predicted = [n for n in heads if any(re.fullmatch(p, n) for p in _PROJ_OUT_IDENTIFIERS)]
    if not predicted:
        return "has no output projection named proj_out for the lite mode to predict"
    if heads != predicted:
        return (f"has output heads the lite mode does not predict ({', '.join(sorted(set(heads) - set(predicted)))}"
                "), which would run on the skipped blocks' zeros")
    if not any(re.fullmatch(p, n) for n, _ in denoiser.named_modules() for p in _BLOCK_IDENTIFIERS):
        return "has no blocks the lite mode knows to skip"
    return ""


# Pipeline classes that set no cache context and make one denoiser call a step as the daemon calls them, so one
# context around the whole call is right, each with the argument that would add a second call
# ('' for none). FLUX's second call is its true CFG's negative pass (``true_cfg_scale > 1``), which the daemon
# passes only to call_defaults.TRUE_CFG families and which defaults to 1: _context_plan checks both still hold.
# Allegro's, Latte's and Bria's CFG runs both passes as one batch (``torch.cat([latents] * 2)``): one call.
# HunyuanVideo image-to-video's second call is the same true CFG (default 1). Its Skyreels sibling is left out,
# refused: its true_cfg_scale defaults to 6, and the daemon passes every class that takes ``negative_prompt`` one
# (``""`` where the request has none: diffusers_pipeline.py), so ``do_true_cfg`` holds and it calls the transformer
# twice a step.
ONE_CALL_A_STEP = {
    "FluxImg2ImgPipeline": "true_cfg_scale",
    "FluxInpaintPipeline": "true_cfg_scale",
    "FluxKontextPipeline": "true_cfg_scale",
    "FluxKontextInpaintPipeline": "true_cfg_scale",
    "FluxControlNetPipeline": "true_cfg_scale",  # the ControlNet siblings of a FLUX model (pipelines/controlnet.py)
    "FluxControlNetImg2ImgPipeline": "",
    "FluxControlNetInpaintPipeline": "",
    "AllegroPipeline": "",
    "LattePipeline": "",
    "BriaPipeline": "",
    "HunyuanVideoImageToVideoPipeline": "true_cfg_scale",
}


_PLANS: dict[type, str] = {}  # by class: reading a __call__'s source costs a file read and a parse


def _context_plan(cls: type) -> str:
    """How a step cache runs under ``cls``: 'own' (its ``__call__`` sets the contexts itself: FluxPipeline, Wan,
    LTX, Qwen-Image), 'one' (one context around the call: ``ONE_CALL_A_STEP``), else why it cannot.

    The first is read off the class's source, so a class diffusers adds or mends is served as it comes. Whether a
    class without contexts makes one denoiser call a step is declared, not read: two calls a step (ChromaPipeline's
    and Kandinsky 5's CFG passes) in one context share one cache state, so every predicted or skipped step is
    computed from the other pass's features (0.65 off on a tiny Chroma at output scale 2, silently),
    and the source cannot tell a concatenated CFG batch (one call) from a loop over the conditions or a call in a
    helper method. A class left out of the table is refused with its name: loud, where a wrong guess is silent."""
    if cls not in _PLANS:
        _PLANS[cls] = _read_plan(cls)
    return _PLANS[cls]


def _read_plan(cls: Any) -> str:
    from diffusiond.pipelines.call_defaults import true_cfg

    try:
        source = inspect.getsource(cls.__call__)
    except (OSError, TypeError, AttributeError):
        source = ""
    if "cache_context" in source:
        return "own"
    second = ONE_CALL_A_STEP.get(cls.__name__)
    if second is None:
        return "sets no step-cache context and is not known to call its denoiser once a step"
    if second:
        declared = inspect.signature(cls.__call__).parameters.get(second)
        default = getattr(declared, "default", None)
        if true_cfg(cls) or not isinstance(default, int | float) or default > 1:
            return (f"calls its denoiser twice a step where {second} > 1, as the daemon calls it, and sets no "
                    "step-cache context")
    return "one"


def step_cache_refusal(option: str, pipe: Any) -> PipelineError | None:
    """The error for ``option`` (``cache=...``) on ``pipe`` if its class cannot run a step cache right
    (``_context_plan``)."""
    plan = _context_plan(type(pipe))
    if plan in ("own", "one"):
        return None
    return PipelineError(
        f"{option}: the pipeline class {type(pipe).__name__} {plan}; its denoiser calls of one step (such as "
        "the conditional and unconditional passes of classifier-free guidance) would share one cache state and the "
        "outputs would be wrong. Load this model without cache= (pipelines that set their own contexts take it: "
        "FLUX, Wan, LTX, Qwen-Image, ...)"
    )


@contextlib.contextmanager
def step_cache_context(pipe: Any) -> Iterator[None]:
    """Around a pipeline call: diffusers' cache hooks need the denoiser's ``cache_context`` set at each of its
    calls. A pipeline that sets its own is left to it; one in ``ONE_CALL_A_STEP`` (FLUX's image-to-image and
    inpainting siblings, whose edit jobs on a cached model all failed) runs in one context around
    the call. Any other was refused at load (``apply_speedups``) when it is the model's own class; an edit sibling
    of another class is refused here, before it runs, rather than run with its passes in one state."""
    cached = [d for _, d in denoisers(pipe) if getattr(d, "is_cache_enabled", False)]
    if cached and (refusal := step_cache_refusal("cache= (the model's step cache)", pipe)) is not None:
        raise refusal
    with contextlib.ExitStack() as stack:
        if cached and _context_plan(type(pipe)) == "one":
            for denoiser in cached:
                stack.enter_context(denoiser.cache_context("cond"))
        yield
