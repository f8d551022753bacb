"""A served folder's request steps and guidance, read off its pipeline class's ``__call__`` defaults.

diffusers writes each family's published settings as its pipeline's ``__call__`` defaults (SD 50 steps at
7.5, SDXL 50 at 5.0, SD3 28 at 7.0, FLUX 28 at 3.5, Qwen-Image 50 at true CFG 4.0, Wan 50 at 5.0, LTX-Video
50 at 3, ...). A folder or hub id carries no table of its own, so without these a FLUX.1-dev folder served
with guidance left out ran at a generic 7.5 (overcooked pictures) and Qwen-Image at true CFG 7.5. Reading
the class rather than keeping a table here means a family diffusers adds is served at its own settings.
Presets' and embedded models' ``defaults`` (``RequestDefaults``) are laid over these, so they still win.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

from diffusiond.pipelines.base import RequestDefaults

__all__ = ["TRUE_CFG", "call_defaults", "negative_prompt_acts", "true_cfg"]

# Families whose guidance is true classifier-free guidance, ``true_cfg_scale`` against the negative prompt
# (their ``guidance_scale`` feeds a guidance embedding only distilled checkpoints have; FLUX's is the reverse).
TRUE_CFG = ("QwenImage",)


def true_cfg(cls: type) -> bool:
    """Whether the daemon's ``guidance`` is ``cls``'s ``true_cfg_scale`` (else its ``guidance_scale``)."""
    return cls.__name__.startswith(TRUE_CFG)


def negative_prompt_acts(cls: type) -> bool:
    """Whether ``cls`` reads a request's negative prompt as the daemon calls it: FLUX's pipelines take
    ``negative_prompt`` but read it only when ``true_cfg_scale > 1``, which only the ``TRUE_CFG`` families get
    (a guidance-distilled model has no negative pass); FLUX.2's and FLUX Control's take none at all."""
    try:
        params = inspect.signature(cls.__call__).parameters
    except (TypeError, ValueError):
        return True
    return "negative_prompt" in params and ("true_cfg_scale" not in params or true_cfg(cls))


def call_defaults(cls: type) -> RequestDefaults:
    """The steps and guidance ``cls.__call__`` declares, as request defaults; a value it leaves out (or
    declares None, as Qwen-Image's ``guidance_scale``, or outside what a request may ask) is absent, so
    the adapter's generic one stays."""
    try:
        params = inspect.signature(cls.__call__).parameters
    except (TypeError, ValueError):
        return {}
    out: RequestDefaults = {}
    steps = _declared(params, "num_inference_steps")
    if steps is not None and steps == int(steps) and steps >= 1:
        out["steps"] = int(steps)
    guidance = _declared(params, "true_cfg_scale" if true_cfg(cls) else "guidance_scale")
    if guidance is not None and 0 <= guidance <= 100:  # a request's guidance_scale range
        out["guidance"] = float(guidance)
    return out


def _declared(params: Any, name: str) -> float | None:
    """The number ``name`` defaults to, or None where it is absent, has no default or is not a finite number."""
    p = params.get(name)
    value = None if p is None else p.default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)
