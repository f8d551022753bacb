"""Preview decoders: the picture a request is turning into, from its latents, for a few microseconds.

The full VAE decode costs about as much as several denoising steps, so a preview never uses it.
The default is the model family's published linear latent -> RGB factors (``preview_factors``):
one small matmul at latent resolution. A diffusers ``AutoencoderTiny`` folder (TAESD and its
kin, ``serve --preview-decoder PATH``) gives sharper pictures for a little more.

Both take the latents diffusers' step callback hands out, whatever their layout (images
``(B, C, h, w)``; Wan videos ``(B, C, F, h, w)``; Flux and LTX pack theirs into tokens
``(B, S, D)``), and return one uint8 ``(H, W, 3)`` picture per asked request, on the
latents' device, scaled so the longer side is the request's ``max_side`` or the output's own,
whichever is smaller. Videos are previewed by their first frame.

They run on the forward's own thread, between two denoising steps, and in an eager forward
that thread is what bounds the speed (the GPU waits for its launches), so every tensor op here
is paid by the forward. Hence the few ops: the linear factors, the [-1, 1] -> [0, 255] mapping
and the rounding offset are folded into one 1x1 convolution, and the picture comes out in the
wire's layout and dtype from one copy, ready for the worker to move into the arena as it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from diffusiond.ipc.messages import BatchParams
from diffusiond.pipelines.errors import PipelineError
from diffusiond.pipelines.preview_factors import (
    FLUX,
    FLUX_BIAS,
    LTX,
    LTX_BIAS,
    SD15,
    SD15_BIAS,
    SDXL,
    SDXL_BIAS,
    WAN,
    WAN_BIAS,
    Row,
)

FAMILIES: dict[str, tuple[tuple[Row, ...], Row]] = {
    "sd15": (SD15, SD15_BIAS),
    "sdxl": (SDXL, SDXL_BIAS),
    "flux": (FLUX, FLUX_BIAS),
    "wan": (WAN, WAN_BIAS),
    "ltx": (LTX, LTX_BIAS),
}


def family_of(pipe: Any) -> str | None:
    """The latent family of a diffusers pipeline, or None when no factors are known for it.

    By class name, then checked against the VAE's latent channels: a fine-tune with another VAE
    would otherwise get pictures made of the wrong factors. LTX-2 (issue 30) has none: its video VAE makes LTX-Video's
    128 channels, so the channel check would pass, but it is another VAE with its own latent space, and the factors
    here are fitted on LTX-Video's decodes; none fitted on LTX-2's are in the table they come from."""
    name = type(pipe).__name__
    family = (
        "flux" if name.startswith("Flux")
        else "wan" if name.startswith("Wan")
        else None if name.startswith("LTX2")  # see below
        else "ltx" if name.startswith("LTX")
        else "sdxl" if name.startswith("StableDiffusionXL")
        else "sd15" if name.startswith("StableDiffusion") and not name.startswith("StableDiffusion3")
        else None
    )
    if family is None:
        return None
    return family if latent_channels(pipe) in (None, len(FAMILIES[family][0])) else None


def latent_channels(pipe: Any) -> int | None:
    """The channels of the model's latents, as its VAE's config says them (None: it does not)."""
    config = getattr(getattr(pipe, "vae", None), "config", None)
    channels = getattr(config, "latent_channels", None) or getattr(config, "z_dim", None)  # Wan's, Qwen's: z_dim
    return channels if isinstance(channels, int) else None


def packing_of(pipe: Any, family: str | None) -> str | None:
    """How the step callback's latents are laid out: "flux" (2x2 latent patches packed into tokens),
    "ltx", "spatial" (not packed), or None: packed in a layout previews do not unpack.

    A family with factors says it; otherwise a pipeline that packs (``_pack_latents``) is asked to pack
    a probe, once at load: many pack as FluxPipeline does (QwenImage, Chroma, Bria, ...) and preview
    through a tiny autoencoder the same way, and the others (FLUX.2's layout) are refused when the
    model loads rather than by the first preview failing its job."""
    if family in ("flux", "ltx"):
        return family
    pack = getattr(type(pipe), "_pack_latents", None)
    if pack is None:
        return "spatial"
    probe = torch.arange(2 * 4 * 4 * 6, dtype=torch.float32).reshape(2, 4, 4, 6)
    try:
        packed = pack(probe, 2, 4, 4, 6)
        flux_like = torch.equal(unpack_flux(packed, BatchParams(width=48, height=32, steps=1, guidance=1.0), 8), probe)
    except Exception:  # another signature, or another layout: not FLUX's
        return None
    return "flux" if flux_like else None


class Previewer(Protocol):
    def __call__(self, latents: torch.Tensor, indices: Sequence[int], params: BatchParams,
                 max_sides: Sequence[int]) -> list[torch.Tensor]:
        """One uint8 (H, W, 3) picture per index of ``latents``' batch, on its device."""
        ...


def preview_size(params: BatchParams, max_side: int) -> tuple[int, int]:
    """(H, W) of a preview: the output's aspect, the longer side ``max_side`` at most."""
    longer = max(params.width, params.height)
    scale = min(1.0, max_side / longer)
    return max(1, round(params.height * scale)), max(1, round(params.width * scale))


def unpack_flux(latents: torch.Tensor, params: BatchParams, vae_scale_factor: int) -> torch.Tensor:
    """Flux's (B, h/2 * w/2, 4C) tokens -> (B, C, h, w): the inverse of ``FluxPipeline._pack_latents``."""
    b, _seq, d = latents.shape
    h = 2 * (params.height // (vae_scale_factor * 2))
    w = 2 * (params.width // (vae_scale_factor * 2))
    x = latents.view(b, h // 2, w // 2, d // 4, 2, 2)
    return x.permute(0, 3, 1, 4, 2, 5).reshape(b, d // 4, h, w)


def unpack_ltx(latents: torch.Tensor, frames: int, height: int, width: int, p: int, pt: int) -> torch.Tensor:
    """LTX's (B, F/pt * h/p * w/p, C*pt*p*p) tokens -> (B, C, F, h, w) (``LTXPipeline._pack_latents``
    inverted); ``frames``, ``height``, ``width`` are latent sizes."""
    b = latents.shape[0]
    x = latents.reshape(b, frames // pt, height // p, width // p, -1, pt, p, p)
    return x.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(b, -1, frames, height, width)


def take(latents: torch.Tensor, indices: Sequence[int]) -> torch.Tensor:
    """``latents[indices]`` without synchronizing the device. Indexing a CUDA tensor with a list
    copies the list to the device with a blocking copy, which waits for every kernel queued before
    it: the host stops running ahead of the GPU at every preview, and the forward pays for it (8 %
    at 1024², SDXL, a preview every step, on the H200). A slice or a stack of views is launched
    like any other kernel."""
    first = indices[0]
    if list(indices) == list(range(first, first + len(indices))):
        return latents[first:first + len(indices)]
    return torch.stack([latents[i] for i in indices])


class _Spatial:
    """Brings step-callback latents laid out as ``packing`` (``packing_of``) to (n, C, h, w) for the
    asked indices."""

    def __init__(self, pipe: Any, packing: str | None) -> None:
        self.pipe = pipe
        self.packing = packing

    def __call__(self, latents: torch.Tensor, indices: Sequence[int], params: BatchParams) -> torch.Tensor:
        x = take(latents, indices)
        if x.dim() == 3:  # packed tokens
            if self.packing == "flux":
                x = unpack_flux(x, params, int(getattr(self.pipe, "vae_scale_factor", 8)))
            elif self.packing == "ltx":
                pipe = self.pipe
                ts = int(getattr(pipe, "vae_temporal_compression_ratio", 8))
                ss = int(getattr(pipe, "vae_spatial_compression_ratio", 32))
                frames = ((params.num_frames or 1) - 1) // ts + 1
                x = unpack_ltx(x, frames, params.height // ss, params.width // ss,
                               int(getattr(pipe, "transformer_spatial_patch_size", 1)),
                               int(getattr(pipe, "transformer_temporal_patch_size", 1)))
            else:
                raise PipelineError(f"previews: packed latents of shape {tuple(latents.shape)} from an unknown family")
        if x.dim() == 5:  # (n, C, F, h, w): the first frame
            x = x[:, :, 0]
        return x


def _pictures(rgb: torch.Tensor, params: BatchParams, max_sides: Sequence[int]) -> list[torch.Tensor]:
    """(n, 3, h, w) float on the 0-255 scale plus 0.5 -> one uint8 (H, W, 3) picture per request.

    The +0.5 makes the conversion's truncation round to nearest; resizing is linear, so adding
    it before the resize is the same as after.
    """
    out: list[torch.Tensor] = []
    cache: dict[tuple[int, int], torch.Tensor] = {}
    for k, side in enumerate(max_sides):
        size = preview_size(params, side)
        if size not in cache:  # requests of a batch mostly ask for the same size: one resize
            x = rgb
            if size != tuple(rgb.shape[-2:]):
                down = size[0] < rgb.shape[-2]
                x = F.interpolate(rgb, size=size, mode="bilinear", align_corners=False, antialias=down)
            pictures = torch.empty((x.shape[0], *size, 3), dtype=torch.uint8, device=x.device)
            pictures.copy_(x.clamp(0, 255).permute(0, 2, 3, 1))  # NHWC and uint8 in one kernel
            cache[size] = pictures
        out.append(cache[size][k])
    return out


class LinearPreviewer:
    """The family's published factors: ``rgb = latents . factors + bias``, mapped from [-1, 1]."""

    def __init__(self, pipe: Any, family: str) -> None:
        factors, bias = FAMILIES[family]
        self.family = family
        self.spatial = _Spatial(pipe, packing_of(pipe, family))
        # [-1, 1] -> [0, 255] (x * 127.5 + 127.5), and +0.5 for _pictures' rounding
        w = torch.tensor(factors, dtype=torch.float32).T * 127.5  # (3, C)
        self._weight = w[:, :, None, None].contiguous()  # a 1x1 convolution's (3, C, 1, 1)
        self._bias = torch.tensor(bias, dtype=torch.float32) * 127.5 + 128.0
        self._on: torch.device | None = None

    def __call__(self, latents: torch.Tensor, indices: Sequence[int], params: BatchParams,
                 max_sides: Sequence[int]) -> list[torch.Tensor]:
        x = self.spatial(latents, indices, params).float()
        if self._on != x.device:  # moved once, not per step
            self._weight, self._bias, self._on = self._weight.to(x.device), self._bias.to(x.device), x.device
        return _pictures(F.conv2d(x, self._weight, self._bias), params, max_sides)


class TinyAutoencoderPreviewer:
    """A diffusers ``AutoencoderTiny`` (TAESD, TAESDXL, TAEF1, ...) decodes the latents at 1/8 of
    the VAE's cost; its latent channels must match the model's."""

    def __init__(self, pipe: Any, path: str, device: torch.device, dtype: torch.dtype) -> None:
        try:
            from diffusers import AutoencoderTiny

            vae = AutoencoderTiny.from_pretrained(path, torch_dtype=dtype)
        except Exception as exc:
            raise PipelineError(f"--preview-decoder {path}: not a diffusers AutoencoderTiny folder ({exc})") from exc
        want, have = latent_channels(pipe), vae.config.latent_channels
        if want is not None and want != have:
            raise PipelineError(f"--preview-decoder {path} decodes {have}-channel latents; the model makes {want}")
        packing = packing_of(pipe, family_of(pipe))
        if packing is None:
            raise PipelineError(
                f"--preview-decoder {path}: {type(pipe).__name__} packs its latents into tokens in a layout previews "
                "do not unpack (they unpack FLUX's, which QwenImage and Chroma share, and LTX's); serve this model "
                "without preview_decoder")
        self.vae = vae.to(device).eval()
        self.dtype = dtype
        self.spatial = _Spatial(pipe, packing)

    def __call__(self, latents: torch.Tensor, indices: Sequence[int], params: BatchParams,
                 max_sides: Sequence[int]) -> list[torch.Tensor]:
        x = self.spatial(latents, indices, params).to(self.dtype)
        rgb = self.vae.decode(x, return_dict=False)[0].float()  # [-1, 1], diffusers' convention
        return _pictures(rgb.mul_(127.5).add_(128.0), params, max_sides)


def make_previewer(pipe: Any, decoder: str, device: torch.device, dtype: torch.dtype) -> Previewer | None:
    """The previewer for ``pipe``: the tiny autoencoder at ``decoder`` if given, else the family's
    factors; None when neither fits (the model then declares no previews)."""
    if decoder:
        return TinyAutoencoderPreviewer(pipe, decoder, device, dtype)
    family = family_of(pipe)
    return LinearPreviewer(pipe, family) if family else None
