"""An upscaler over a picture in overlapping tiles, blended back with feathered weights, as ComfyUI's
"upscale image (using model)" does.

Why tiles: a super-resolution network's working memory grows with the picture (a 4x ESRGAN holds
its activations at the output's size: several GiB over a 1024² picture, in float32), while a
tile's is fixed by its side, so a 12-24 GB card upscales any picture without evicting models.

Why the blend hides the seams: a convolutional upscaler's output pixel depends only on the input
within its receptive field, so a tile's output differs from the whole picture's only near the
tile's inner edges, where the tile saw zero padding instead of its neighbour. Neighbours share
``overlap`` input pixels; across that band each tile's weight ramps linearly from near 0 at its own
edge to 1, so the pixels a tile got wrong count least, and the weights are summed and divided out
per pixel, so the blend is a convex mix with no step where a band starts or ends. The picture's
own edges are not feathered: no other tile covers them, and the whole picture's run sees the same
padding there.

Every tile of a picture has one size: the last tile of a row or a column is moved back inside the
picture (overlapping its neighbour by more than ``overlap``) rather than padded, so no tile runs on
made-up pixels, and every tile of every picture in a batch goes through the model with the
others, ``batch`` at a time.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from diffusiond.ipc.upscale import MIN_TILE
from diffusiond.pipelines.errors import PipelineError

TILE_BATCH = 4
"""Tiles per forward: enough to keep a GPU's kernels full on 512² tiles (one tile of a small model
leaves it mostly idle), few enough that the batch's working memory stays near one tile's x 4."""


def starts(size: int, tile: int, overlap: int) -> list[int]:
    """Where tiles of ``tile`` pixels begin along a side of ``size``: ``tile - overlap`` apart, the last
    one ending at the side's end. Neighbours share at least ``overlap`` pixels (the last pair may
    share more)."""
    if size <= tile:
        return [0]
    return [*range(0, size - tile, tile - overlap), size - tile]


def ramp(length: int, width: int, before: bool, after: bool) -> torch.Tensor:
    """A tile's weight along one side of ``length`` output pixels: 1, ramping linearly over ``width``
    pixels to near 0 at an edge with a neighbour (``before``, ``after``). Two neighbours' ramps over
    a band of exactly ``width`` sum to 1 at every pixel of it (a cross-fade)."""
    w = torch.ones(length)
    width = min(width, length)
    if width > 0:
        up = (torch.arange(width, dtype=torch.float32) + 0.5) / width
        if before:
            w[:width] = torch.minimum(w[:width], up)
        if after:
            w[-width:] = torch.minimum(w[-width:], up.flip(0))
    return w


def upscale_tiled(forward: Callable[[torch.Tensor], torch.Tensor], images: torch.Tensor, tile: int, overlap: int,
                  batch: int = TILE_BATCH) -> torch.Tensor:
    """``images`` (N, C, H, W) through ``forward`` in tiles of ``tile`` input pixels (a side no longer
    than ``tile`` is one tile), ``batch`` tiles per call; the blended (N, C', H*s, W*s), unclamped."""
    n, _, h, w = images.shape
    th, tw = min(tile, h), min(tile, w)
    ys, xs = starts(h, tile, overlap), starts(w, tile, overlap)
    boxes = [(i, y, x) for i in range(n) for y in ys for x in xs]
    out: torch.Tensor | None = None
    weights: dict[tuple[int, int], torch.Tensor] = {}
    sy = sx = 0
    for k in range(0, len(boxes), batch):
        part = boxes[k:k + batch]
        got = forward(torch.stack([images[i, :, y:y + th, x:x + tw] for i, y, x in part]))
        if out is None:
            sy, sx = got.shape[-2] // th, got.shape[-1] // tw
            if sy < 1 or sx < 1 or got.shape[-2:] != (th * sy, tw * sx):
                raise PipelineError(f"the upscaler made {tuple(got.shape[-2:])} of a {th}x{tw} tile, not a whole "
                                    "multiple of it")
            out = torch.zeros((n, got.shape[1], h * sy, w * sx), dtype=torch.float32, device=got.device)
            weights = {(y, x): (ramp(th * sy, overlap * sy, y != ys[0], y != ys[-1])[:, None]
                                * ramp(tw * sx, overlap * sx, x != xs[0], x != xs[-1])[None, :]).to(got.device)
                       for y in ys for x in xs}
        for (i, y, x), t in zip(part, got, strict=True):
            out[i, :, y * sy:(y + th) * sy, x * sx:(x + tw) * sx].add_(t.float() * weights[y, x])
        del got
    assert out is not None
    total = torch.zeros(out.shape[-2:], dtype=torch.float32, device=out.device)
    for (y, x), m in weights.items():
        total[y * sy:(y + th) * sy, x * sx:(x + tw) * sx].add_(m)
    return out.div_(total)


def whole(tile: int, height: int, width: int) -> bool:
    """Whether a picture runs in one piece: tiles off (0), or no side longer than one tile."""
    return tile == 0 or (height <= tile and width <= tile)


def smaller(tile: int, overlap: int, height: int, width: int) -> tuple[int, int] | None:
    """The tiles to retry with after running out of memory: half the side that ran (the picture's
    longer side where it ran whole), the overlap kept under half of that; None below ``MIN_TILE``."""
    side = max(height, width) if whole(tile, height, width) else tile
    half = side // 2
    if half < MIN_TILE:
        return None
    return half, min(overlap, (half - 1) // 2)
