"""``vae_tiling=1``'s strides, fitted per call so no tile of a decode is thinner than its decoder takes (issue 30).

diffusers' tiled decode (the LTX-2 video VAE's, as LTX-Video's and Wan's) starts a tile every ``stride`` latent
pixels along each side, from 0 while the start is inside the side, and decodes ``tile`` latent pixels from there;
every side is cut so once either side is longer than a tile. The last tile of a side of ``n`` latent pixels is then
``(n - 1) % stride + 1`` thick. A decoder that pads by reflection cannot take a strip of one pixel (the padding must
be thinner than its input), and LTX-2's does: at its 512-pixel tiles every 448 (16 and 14 latent pixels at 32x),
sides of 480, 928, 1376... pixels (``n - 1`` a multiple of 14) failed inside the VAE, 704x480 (LTX's usual size)
included. For those sizes the call runs with the largest stride under the default that leaves the last strip thick
enough: the tiles overlap more (the blend is wider), and every other size decodes exactly as diffusers would.
Zero-padding decoders (LTX-Video, Wan) decode a one-pixel strip, so their strides are never touched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from diffusiond.pipelines.frame_rules import decoder_need

_SIDES = (("tile_sample_min_height", "tile_sample_stride_height"),
          ("tile_sample_min_width", "tile_sample_stride_width"))


def fitted_stride(side: int, stride: int, need: int) -> int:
    """The largest latent stride up to ``stride`` whose last strip along ``side`` latent pixels is at least ``need``
    thick (``stride`` itself where it is; where none is, ``stride``, and the decoder's own error says why)."""
    for s in range(stride, need - 1, -1):
        if (side - 1) % s + 1 >= need:
            return s
    return stride


@contextlib.contextmanager
def fitted(pipe: Any, height: int, width: int) -> Iterator[None]:
    """For one call of ``height`` x ``width`` pixels: the pipeline's VAE tiled with strides that leave no strip too
    thin (``fitted_stride``), put back after the call."""
    vae = getattr(pipe, "vae", None)
    ratio = getattr(vae, "spatial_compression_ratio", None)
    if not getattr(vae, "use_tiling", False) or not isinstance(ratio, int) or ratio < 1:
        yield
        return
    # a VAE tiled otherwise (Allegro's, HunyuanImage's: no such attributes) or that decodes any strip is left alone
    tiled_so = all(isinstance(getattr(vae, name, None), int) for pair in _SIDES for name in pair)
    need = decoder_need(vae) if tiled_so else 1
    if need <= 1:
        yield
        return
    saved = {stride: getattr(vae, stride) for _, stride in _SIDES}
    try:
        for (tile, stride), side in zip(_SIDES, (height, width), strict=True):
            latent = int(saved[stride]) // ratio
            if int(getattr(vae, tile)) // ratio > latent > 0:
                setattr(vae, stride, fitted_stride(side // ratio, latent, need) * ratio)
        yield
    finally:
        for name, value in saved.items():
            setattr(vae, name, value)
