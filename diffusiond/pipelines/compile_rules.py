"""Which model options ``--compile`` cannot go with, read without torch.

The engine asks at start (daemon/warmup.py), before any worker loads the model, and the worker's
``CompiledPipeline`` asks again (the bench and in-process callers come that way): a combination
that loads "ready" and then fails or silently runs eager at the first job is worse than a refusal.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["compile_refusal"]


def compile_refusal(options: Mapping[str, str]) -> str:
    """Why ``--compile`` cannot go with ``options``, with what to do; '' when it can.

    - A step cache (``cache=``): diffusers' cache hooks call a ``torch.compiler.disable``d function
      inside each block, and the blocks are compiled ``fullgraph`` (pipelines/compile.py), so every
      job would fail with a dynamo error after the model reports ready.
    ``fp8-storage`` was refused too while it was diffusers' layerwise casting (dynamo recompiled its hooks layer
    by layer); its own cast in each layer's forward (``fp8_storage.py``) compiles like any forward.
    """
    cache = options.get("cache")
    if cache:
        return (f"--compile with cache={cache} is refused: the step cache's hooks cannot be traced inside the "
                "compiled blocks, so every job would fail; drop cache= (compiled, exact) or --compile (cached, "
                "eager)")
    return ""
