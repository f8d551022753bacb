"""A batch's post-processing on the worker: an upscaler over every output, and the hires second pass.

Both are in ``BatchParams`` (the batch key): requests that differ in either compute different things,
so they never share a batch. The sizes are the engine's, decided at admission, so the worker never
rounds one and the output's size is known before the job runs (the output limit counts it).

How a served upscaler runs is the daemon's setting, not the request's: ``serve --upscaler
NAME=PATH,tile=512,overlap=32`` (``UpscalerSetting``), the same for every job that names it.
"""

from __future__ import annotations

import msgspec

DEFAULT_TILE = 512
"""Input pixels a tile's side has unless ``serve`` says otherwise: ComfyUI's default, which keeps a
4x ESRGAN's working memory near 1 GiB (float32) whatever the picture's size."""
DEFAULT_OVERLAP = 32
"""Input pixels neighbouring tiles share, where their outputs are blended: about the depth at which
an ESRGAN's output stops seeing a tile's edge (its zero padding) instead of the picture."""
MIN_TILE = 16
"""The smallest tile side ``serve`` takes, and the floor of the out-of-memory retry's halving: below
it a tile is mostly border, and the model's own padding rules (a window of 8 or 16) dominate."""
MAX_TILE = 16384  # the largest side a picture may have (an upscaled output's too)


class UpscalerSetting(msgspec.Struct, frozen=True, kw_only=True):
    """One served upscaler: its file, and the tiles it runs in. ``tile`` 0 runs every picture whole;
    a picture no larger than one tile runs whole too, so the setting only changes larger ones."""

    path: str
    tile: int = DEFAULT_TILE
    overlap: int = DEFAULT_OVERLAP


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


def img2img_steps(schedule: int, strength: float, flow: bool) -> int:
    """The denoising steps diffusers' image-to-image pipeline runs when asked for ``schedule`` steps
    at ``strength``, by its own rule (its ``get_timesteps``), float rounding included. SD and SDXL
    run ``int(schedule * strength)``; the flow-matching families (FLUX, SD3, Qwen-Image, Chroma,
    Z-Image) skip ``int(schedule - schedule * strength)`` and run the rest, which rounds the other way."""
    if flow:
        return schedule - int(max(schedule - min(schedule * strength, schedule), 0))
    return min(int(schedule * strength), schedule)


def hires_schedule(steps: int, strength: float, flow: bool) -> int:
    """The ``num_inference_steps`` to ask diffusers for so that image-to-image at ``strength`` runs
    exactly ``steps`` steps (``img2img_steps``): of those that do, the one nearest ``steps / strength``,
    whose skipped part of the schedule is nearest ``1 - strength``. A flow pipeline's rule is met by
    schedules up to ``steps / strength`` (the smallest, ``steps`` itself at a high strength, would start
    from pure noise), SD's from ``steps / strength`` up, so the nearest is the largest or the smallest.

    A ``steps / strength`` past any schedule the daemon runs comes back as it is, for the caller to refuse."""
    ideal = steps / strength
    if ideal > 1e6:
        return int(min(ideal, 2**62))
    centre = max(steps, int(ideal))
    near = [n for n in range(max(steps, centre - 2), centre + 3) if img2img_steps(n, strength, flow) == steps]
    if not near:  # float rounding far from the centre: look everywhere the rule could be met
        near = [n for n in range(steps, centre + 3 + steps) if img2img_steps(n, strength, flow) == steps]
    return min(near or [centre], key=lambda n: (abs(n - ideal), n))
