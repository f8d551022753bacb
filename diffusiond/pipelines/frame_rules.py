"""What sizes and frame counts a model makes, read off its diffusers pipeline before any request runs.

Declared in the capabilities so admission refuses a size or a frame count the model cannot make with the
nearest ones it can, never a job failing mid-compute or (worse) a pipeline silently rounding.
"""

from __future__ import annotations

from typing import Any

from diffusiond.pipelines.base import PipelineError
from diffusiond.protocol import frame_count_neighbours


def frame_step(pipe: Any) -> int:
    """Output frames per latent frame after the first: a video VAE that compresses time by k
    decodes 1 + k*(latent frames - 1) frames, so only counts of the form k*n+1 come out whole.
    Pipelines round other counts silently (Wan, LTX), which would hand back fewer frames than asked."""
    for attr in ("vae_scale_factor_temporal", "vae_temporal_compression_ratio"):
        step = getattr(pipe, attr, None)
        if isinstance(step, int) and step > 1:
            return step
    return 1


def size_step(pipe: Any) -> int:
    """The multiple width and height must be: the VAE's spatial compression times the denoiser's
    patch side. LTX asks for multiples of 32 and fails on others inside the transformer; SD3 and
    Wan patch 2x2 latents (16); Flux packs 2x2 latents too. Declared in the capabilities so
    admission refuses other sizes with the nearest valid ones, never a job failing mid-compute."""
    factor = spatial_factor(pipe)
    if factor == getattr(pipe, "vae_spatial_compression_ratio", None):  # LTX's
        patch = getattr(pipe, "transformer_spatial_patch_size", 1)
        return max(8, factor * (patch if isinstance(patch, int) and patch > 0 else 1))
    patch = getattr(getattr(getattr(pipe, "transformer", None), "config", None), "patch_size", None)
    side = patch[-1] if isinstance(patch, list | tuple) and patch else patch
    side = side if isinstance(side, int) and side > 0 else 1
    if hasattr(pipe, "_pack_latents"):  # Flux: 2x2 latent patches packed into tokens
        side = max(side, 2)
    return max(8, factor * side)


def spatial_factor(pipe: Any) -> int:
    """Output pixels per latent pixel a side: the VAE's spatial compression (LTX's own attribute, else
    ``vae_scale_factor_spatial`` or ``vae_scale_factor``; 8 when the pipeline names none)."""
    ltx = getattr(pipe, "vae_spatial_compression_ratio", None)
    if isinstance(ltx, int) and ltx > 0:
        return ltx
    return int(getattr(pipe, "vae_scale_factor_spatial", None) or getattr(pipe, "vae_scale_factor", None) or 8)


def min_side(pipe: Any, step: int) -> int:
    """The smallest width and height the model makes: one ``step``, or more where the VAE's decoder pads its
    convolutions by reflection, which needs more latent pixels a side than the padding (issue 30). LTX-2's
    decoder does (padding 1): a 32-pixel side is one latent pixel there and fails inside the call, so its
    smallest side is 64. Zero-padding decoders (SD, FLUX, Wan, LTX-Video) decode a single latent pixel.
    A decoder only grows what it is given, so the latents are the smallest map its convolutions see."""
    need = decoder_need(getattr(pipe, "vae", None))
    return -(-need * spatial_factor(pipe) // step) * step  # rounded up to a multiple of step


def decoder_need(vae: Any) -> int:
    """The fewest latent pixels a side ``vae``'s decoder takes: one more than its widest reflection padding
    (1 where it pads with zeros), what ``min_side`` and a tiled decode's last strip (vae_tiles.py) must give it."""
    decoder: Any = getattr(vae, "decoder", None)
    need = 1
    for m in decoder.modules() if callable(getattr(decoder, "modules", None)) else ():
        pad = getattr(m, "padding", None)
        if getattr(m, "padding_mode", None) == "reflect" and isinstance(pad, tuple):
            need = max([need, *(p + 1 for p in pad[-2:] if isinstance(p, int))])
    return need


def check_frames(name: str, step: int, frames: int) -> None:
    """Refuse a frame count the model cannot make, naming the nearest ones it can."""
    near = frame_count_neighbours(frames, step)
    if near is not None:
        raise PipelineError(
            f"{name} makes videos of {step}k+1 frames (1, {1 + step}, {1 + 2 * step}, {1 + 3 * step}, ...); "
            f"num_frames={frames} is not one: use {near[0]} or {near[1]}"
        )
