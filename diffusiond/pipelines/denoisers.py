"""Which modules of a diffusers pipeline denoise: what ``--compile``, ``attention``, ``cache`` and ``fp8`` apply to.

Most pipelines have one (``unet`` or ``transformer``); Wan 2.2 A14B has two experts, ``transformer`` for the
high-noise steps and ``transformer_2`` for the low-noise ones, each running about half the steps. An option
given to the model is meant for every step, so it goes to both; applied to the first alone, half the steps
would run eager or on the default attention while the model's fields claim otherwise.

Imports no torch at module level (attention.py, which the engine imports, asks for them at load only).
"""

from __future__ import annotations

from typing import Any

__all__ = ["DENOISERS", "denoisers"]

DENOISERS = ("transformer", "transformer_2", "unet")
"""The pipeline attributes that hold a denoiser, in the order the options are applied and named."""


def denoisers(pipe: Any) -> list[tuple[str, Any]]:
    """The pipeline's denoisers, each with its attribute's name; none missing or set to None."""
    import torch

    found = [(name, getattr(pipe, name, None)) for name in DENOISERS]
    return [(name, module) for name, module in found if isinstance(module, torch.nn.Module)]
