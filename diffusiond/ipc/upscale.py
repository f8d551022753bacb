"""A batch's post-processing on the worker: an upscaler over every output, and the hires second pass.

Both are in ``BatchParams`` (the batch key): requests that differ in either compute different things,
so they never share a batch. The sizes are the engine's, decided at admission, so the worker never
rounds one and the output's size is known before the job runs (the output limit counts it).
"""

from __future__ import annotations

import msgspec


class UpscaleSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Every output through upscaler ``name``, then resized to ``width`` x ``height`` where the
    model's own scale does not give that size."""

    name: str
    scale: float
    width: int
    height: int


class HiresSpec(msgspec.Struct, frozen=True, kw_only=True):
    """The second pass: the first pass's picture made ``width`` x ``height`` (by ``upscaler``, else
    a bicubic resize), then image-to-image on it at ``strength``, running ``steps`` denoising steps
    (diffusers is asked for ``schedule`` steps, of which ``strength`` runs the last ``steps``)."""

    width: int
    height: int
    strength: float
    steps: int
    schedule: int
    upscaler: str | None = None


def hires_schedule(steps: int, strength: float) -> int:
    """The ``num_inference_steps`` to ask diffusers for so that image-to-image at ``strength`` runs
    ``steps`` steps: it runs ``int(schedule * strength)`` of them (the last ones)."""
    schedule = max(steps, int(steps / strength))
    while int(schedule * strength) < steps:
        schedule += 1
    return schedule
