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

The tile is chosen up front from the device's free memory (``planned``), so a card that is short of
memory gets smaller tiles before it runs out rather than after. The figure per pixel is measured, not
guessed from the architecture: when a worker loads an upscaler on a CUDA device it runs one probe of
``PROBE``² input pixels and reads the caching allocator's peak above what was allocated before
(pipelines/upscalers.py), so the figure holds whatever the model keeps alive (ESRGAN's features at
the output's size, a SwinIR's windows), its output included. A run's working memory is then taken as
linear in its pixels, times ``PLAN_MARGIN``: ``batch`` tiles of side t need ``batch x t² x margin x
per_pixel``, plus the blend's own buffers at the output's size (``blend_bytes``). The largest side
that fits ``FREE_SHARE`` of the free memory is used when it is smaller than the one ``serve`` set
(never larger: the setting is the ceiling), and not below ``MIN_TILE``; a picture that would run
whole (tile 0, or no side over the tile) stays whole when all of the batch's pictures fit at once,
and is tiled like any other when they do not. On a CPU, or with no probe, the setting is used as
given. Running out of memory anyway (the linear model is an estimate: cuDNN picks other algorithms
at other sizes, the allocator fragments) still retries once in tiles of half the side that ran
(``smaller``, worker/finish.py).

Every tile of a picture has one size: the last tile of a row or a column is moved back inside the
picture (overlapping its neighbour by more than ``overlap``) rather than padded, so no tile runs on
made-up pixels, and every tile of every picture in a batch goes through the model with the
others, ``batch`` at a time.
"""

from __future__ import annotations

import math
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


def _with_overlap(side: int, overlap: int) -> tuple[int, int]:
    """A tile side with the overlap kept under half of it (neighbours must not share a tile's middle)."""
    return side, min(overlap, (side - 1) // 2)


def smaller(tile: int, overlap: int, height: int, width: int) -> tuple[int, int] | None:
    """The tiles to retry with after running out of memory: half the side that ran (the picture's
    longer side where it ran whole), the overlap kept under half of that; None below ``MIN_TILE``."""
    side = max(height, width) if whole(tile, height, width) else tile
    half = side // 2
    if half < MIN_TILE:
        return None
    return _with_overlap(half, overlap)


PROBE = 128
"""The probe's input side: large enough that a convolution's fixed workspace does not dominate the
figure per pixel, small enough to cost milliseconds at a worker's start (a 4x ESRGAN: 67 MB)."""
PLAN_MARGIN = 1.5
"""How many times the probe's bytes per pixel a planned run is counted at: the figure is measured at
one size, and a larger tile may get another cuDNN algorithm with its own workspace."""
FREE_SHARE = 0.9
"""The share of the free memory a plan may fill: the caching allocator rounds blocks up and fragments."""


def blend_bytes(count: int, height: int, width: int, scale: int) -> int:
    """The tiled path's own buffers, float32 at the output's size: the blend (``count`` pictures of 3
    channels), the weights' sum, and one weight per tile position (overlapping: counted twice)."""
    return (3 * count + 3) * height * scale * width * scale * 4


def planned(tile: int, overlap: int, count: int, height: int, width: int, scale: int, per_pixel: float, free: int,
            batch: int = TILE_BATCH) -> tuple[int, int]:
    """The tiles to run ``count`` pictures of ``height`` x ``width`` in: serve's (``tile``, ``overlap``),
    or a smaller side when ``free`` bytes would not hold their working memory at ``per_pixel`` bytes per
    input pixel (the module's docstring has the rule)."""
    need, budget = per_pixel * PLAN_MARGIN, free * FREE_SHARE
    if whole(tile, height, width) and count * height * width * need <= budget:
        return tile, overlap
    room = budget - blend_bytes(count, height, width, scale)
    fits = math.isqrt(int(max(room, 0) / (batch * need))) if need > 0 else tile or max(height, width)
    ceiling = tile or max(height, width)
    if fits >= ceiling:
        return tile, overlap
    return _with_overlap(max(MIN_TILE, fits), overlap)
