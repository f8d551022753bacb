"""Which model options ``--compile`` cannot go with, read without torch.

The engine asks at start (daemon/warmup.py), before any worker loads the model, and the worker's
``CompiledPipeline`` asks again (the bench and in-process callers come that way): a combination
that loads "ready" and then fails or silently runs eager at the first job is worse than a refusal.
"""

from __future__ import annotations

from collections.abc import Mapping

from diffusiond.pipelines.errors import PipelineError
from diffusiond.pipelines.spec import parse_quant

__all__ = ["TEXT_ENCODERS", "compile_refusal", "left_eager"]

TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")
"""The components ``--compile`` compiles whole beside the denoisers and the VAE decoder, unless ``left_eager``."""


def left_eager(options: Mapping[str, str], regional: bool) -> tuple[str, ...]:
    """The text encoders ``--compile`` leaves eager. An encoder runs once an image, so compiling it buys little, and
    each start pays for it: with ``compile_encoders`` unset, beside a denoiser compiled regionally (a transformer,
    where the steps dominate and a regional compile is chosen for its compile time) they stay eager; beside a UNet
    (small images, launch-bound) they are compiled. Measured on an H100 for FLUX.1-dev (docs/benchmarks.md): the
    cold start 57.1 s eager against 90.8 s compiled, each image 0.9 % slower. ``compile_encoders=1|0`` decides
    instead. Those stored in fp8 (``quant=text_encoder_2:fp8-storage``) stay eager whatever is asked: their
    casting hooks cannot be compiled (``compile_refusal``)."""
    asked = options.get("compile_encoders")
    if asked == "0" or (asked != "1" and regional):
        return TEXT_ENCODERS
    try:
        quant = parse_quant(options["quant"]) if options.get("quant") else {}
    except PipelineError:
        return ()
    return tuple(c for c in TEXT_ENCODERS if quant.get(c) == "fp8-storage")


def compile_refusal(options: Mapping[str, str]) -> str:
    """Why ``--compile`` cannot go with ``options``, with what to do; '' when it can.

    - A step cache (``cache=``): diffusers' cache hooks call a ``torch.compiler.disable``d function
      inside each block, and the blocks are compiled ``fullgraph`` (pipelines/compile.py), so every
      job would fail with a dynamo error after the model reports ready.
    - ``fp8-storage`` on a denoiser or the VAE: diffusers' layerwise casting hooks re-cast each layer around
      its forward; dynamo recompiles the hook per layer until its recompile limit and then runs it eager, so
      the model is neither compiled nor told so. A text encoder in fp8 storage is left eager instead
      (``left_eager``).
    """
    cache = options.get("cache")
    if cache:
        return (f"--compile with cache={cache} is refused: the step cache's hooks cannot be traced inside the "
                "compiled blocks, so every job would fail; drop cache= (compiled, exact) or --compile (cached, "
                "eager)")
    try:
        quant = parse_quant(options["quant"]) if options.get("quant") else {}
    except PipelineError:
        return ""  # a malformed quant= is refused with its own message by the option check
    stored = sorted(c for c, method in quant.items() if method == "fp8-storage" and c not in TEXT_ENCODERS)
    if stored:
        named = ",".join(f"{c}:fp8-storage" for c in stored)
        return (f"--compile with quant={named} is refused: its per-layer casting hooks make torch.compile "
                "recompile each layer until its limit and then run eager; drop --compile, or give those "
                "components another method (int8, fp8: torchao) or none")
    return ""
