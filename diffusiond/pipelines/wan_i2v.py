"""Wan image-to-video as diffusiond drives it: one picture per request, N requests in one diffusers call.

``WanImageToVideoPipeline`` (diffusers 0.42) is written for one image shared by every prompt of a call, and
a batch here is N requests with N pictures and N generators. Run as it is, a batch of two fails (issue 30):

- ``prepare_latents`` encodes the whole batch of pictures once per generator, N² image latents for N
  noises (Wan 2.1 I2V and Wan 2.2 TI2V alike);
- Wan 2.1 I2V's ``encode_image`` embeds the N pictures with CLIP and ``__call__`` then repeats that
  batch once per prompt, N² embeddings again; and it hands the picture to ``CLIPImageProcessor`` as the
  float [0, 1] tensor the call takes, which the processor rescales by 1/255 a second time, so the encoder
  saw a near-black picture. ``image_embeds`` cannot be passed instead: the call refuses it beside
  ``image``, which the latents need.

``fit`` mends both on the pipeline instance: latents are prepared one request at a time (with its own
generator, as a request run alone is, so batching never changes an output), and each picture is
embedded from its 8-bit pixels, handed on as the one-per-prompt batch it already is. It also gives the
module the prompt cleaning ``WanPipeline`` has when the optional ``ftfy`` package is missing (0.42's
image-to-video module calls ``ftfy`` unguarded: every job failed with ``NameError``).
"""

from __future__ import annotations

from types import MethodType
from typing import Any

import numpy as np
import torch


def takes_image(pipe: Any) -> str | None:
    """Why a ``WanPipeline`` cannot animate an image, or None when it can: only a model trained with
    per-patch timesteps (Wan 2.2 TI2V, ``expand_timesteps``) has its first latent frame replaced by
    the image's; a Wan 2.1 or Wan 2.2 A14B text-to-video transformer has no input for it (their
    image-to-video models are other weights, served from their own folders)."""
    if pipe.config.get("expand_timesteps"):
        return None
    return "its transformer is text-to-video only (no expand_timesteps: not a Wan 2.2 TI2V model)"


def fit(pipe: Any) -> Any:
    """``pipe`` (a WanImageToVideoPipeline) made to take a batch of pictures, one per request."""
    import diffusers.pipelines.wan.pipeline_wan as wan
    import diffusers.pipelines.wan.pipeline_wan_i2v as wan_i2v

    if getattr(wan_i2v, "ftfy", None) is None and wan_i2v.basic_clean is not wan.basic_clean:
        wan_i2v.basic_clean = wan.basic_clean  # WanPipeline's: ftfy's repairs only where it is installed
    pipe.prepare_latents = MethodType(_prepare_each, pipe)
    transformer = getattr(pipe, "transformer", None)
    if getattr(pipe, "image_encoder", None) is not None and getattr(transformer, "config", {}).get("image_dim"):
        pipe.encode_image = MethodType(_encode_each, pipe)
    return pipe


def _prepare_each(self: Any, image: torch.Tensor, batch_size: int, *args: Any) -> tuple[torch.Tensor, ...]:
    """``prepare_latents`` once per request, each with its picture and its generator.

    Positional as diffusers calls it: channels, height, width, frames, dtype, device, generator,
    latents, last image. What comes back per request is the noise and the picture's condition (for
    TI2V also the first-frame mask, one for the whole batch); they are joined along the batch."""
    from diffusers import WanImageToVideoPipeline

    prepare = WanImageToVideoPipeline.prepare_latents
    generator = args[6] if len(args) > 6 else None
    if not isinstance(generator, list) or batch_size < 2 or image.shape[0] != batch_size:
        return prepare(self, image, batch_size, *args)
    head, latents, last = args[:6], (args[7] if len(args) > 7 else None), (args[8] if len(args) > 8 else None)
    parts = [prepare(self, image[k:k + 1], 1, *head, [generator[k]], None if latents is None else latents[k:k + 1],
                     None if last is None else last[k:k + 1]) for k in range(batch_size)]
    return (torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), *parts[0][2:])


def _encode_each(self: Any, image: Any, device: Any = None) -> torch.Tensor:
    """CLIP's embedding of each picture from its 8-bit pixels (the processor's own rescale and
    normalisation then apply once), one per prompt."""
    from diffusers import WanImageToVideoPipeline
    from PIL import Image

    encode = WanImageToVideoPipeline.encode_image
    if not isinstance(image, torch.Tensor):
        return encode(self, image, device)
    batch = image if image.dim() == 4 else image.unsqueeze(0)
    pixels = (batch.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    embeds = torch.cat([encode(self, Image.fromarray(np.ascontiguousarray(p)), device) for p in pixels])
    return embeds.as_subclass(_OnePerPrompt)


class _OnePerPrompt(torch.Tensor):
    """Image embeddings that are already one per prompt. ``__call__`` repeats what ``encode_image``
    returns once per prompt (``image_embeds.repeat(batch_size, 1, 1)``, meant for one shared image);
    this batch goes on as it is, a plain tensor from there (no torch function keeps the subclass)."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    def repeat(self, *sizes: Any) -> torch.Tensor:
        plain = self.as_subclass(torch.Tensor)
        sizes = tuple(sizes[0]) if len(sizes) == 1 and isinstance(sizes[0], tuple | list) else sizes
        if tuple(sizes) == (plain.shape[0], *[1] * (plain.dim() - 1)):
            return plain
        return plain.repeat(*sizes)
