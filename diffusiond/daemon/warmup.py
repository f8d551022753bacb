"""``--warmup``: the shapes a worker runs before it reports ready, as written and as resolved.

A shape is ``WxH`` (batch 1), ``WxH:B`` or ``WxH:all``: every batch size the model's batches form in
(core/scheduler.py: the powers of two up to ``--max-batch`` and max_batch itself, for a compiled model).
``all`` needs the model's configuration to mean anything, so it is read here as ``WARMUP_ALL`` and made
sizes by ``resolve_warmup`` once ``config.py`` knows max_batch and whether the model compiles.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from diffusiond.daemon.values import ConfigError
from diffusiond.pipelines.compile_rules import compile_refusal
from diffusiond.pipelines.errors import PipelineError
from diffusiond.pipelines.spec import compile_shapes

WARMUP_ALL = 0
"""The batch of ``WxH:all`` until ``resolve_warmup`` replaces it with the model's batch sizes."""

Shape = tuple[int, int, int]  # (width, height, batch)


def parse_warmup(text: str) -> tuple[Shape, ...]:
    """``512x512:1,1024x1024:4,512x512:all`` (WxH, WxH:BATCH or WxH:all; batch 1 when left out) -> shapes."""
    shapes = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        size, _, batch = part.partition(":")
        w, x, h = size.partition("x")
        every = batch.strip().lower() == "all"
        if not (x and w.isdigit() and h.isdigit() and (batch.isdigit() or not batch or every)):
            raise ConfigError(f"warmup {part!r} is not WxH, WxH:BATCH or WxH:all (e.g. --warmup 512x512:1,512x512:8 "
                              "or --warmup 512x512:all)")
        shape = (int(w), int(h), WARMUP_ALL if every else int(batch or 1))
        if min(shape[:2]) < 1 or (shape[2] < 1 and not every):
            raise ConfigError(f"warmup {part!r}: width, height and batch must be at least 1")
        shapes.append(shape)
    return tuple(shapes)


def warmup_value(value: Any) -> tuple[Shape, ...]:
    """A string (``"512x512:1,512x512:8"``, as on the command line) or a TOML list of them."""
    if isinstance(value, list | tuple):
        return tuple(shape for v in value for shape in parse_warmup(str(v)))
    return parse_warmup(str(value))


def resolve_warmup(model: str, shapes: Sequence[Shape], sizes: Sequence[int], compiled: str,
                   options: Mapping[str, str]) -> tuple[Shape, ...]:
    """``shapes`` with ``WxH:all`` made ``sizes`` (the model's batch sizes) and each shape once.

    ``all`` on an eager model is refused: it warms what a compile would cost, and an eager batch
    compiles nothing. A compiled model's warm-up must fit its ``compile_shapes``: past the bound the
    worker keeps no graph (the shape runs eager), so the rest would be start-up time for nothing.
    Options a compile cannot go with (pipelines/compile_rules.py) are refused here too, before any load."""
    refusal = compile_refusal(options) if compiled else ""
    if refusal:
        raise ConfigError(f"model {model!r}: {refusal}")
    every = [(w, h) for w, h, b in shapes if b == WARMUP_ALL]
    if every and not compiled:
        raise ConfigError(f"model {model!r}: warmup {every[0][0]}x{every[0][1]}:all warms the batch sizes a compiled "
                          f"model compiles, and {model!r} is not compiled (an eager batch compiles nothing); give "
                          "--compile MODE, batch numbers (WxH:B), or this model's table its own warmup = []")
    out = tuple(dict.fromkeys((w, h, s) for w, h, b in shapes for s in (sizes if b == WARMUP_ALL else (b,))))
    for w, h, b in out:
        if w % 8 or h % 8:  # every model's least multiple; the worker holds them to the model's own (FLUX 16)
            raise ConfigError(f"model {model!r}: --warmup {w}x{h}:{b}: width and height must be multiples of 8 "
                              "(16 on FLUX, SD3 and Wan, 32 on LTX), the sizes a request may ask for")
        if b not in sizes:
            raise ConfigError(f"model {model!r}: --warmup {w}x{h}:{b}: batches of {b} never form (its batch sizes "
                              f"are {', '.join(map(str, sizes))}: --batch-sizes), so its compile would be start-up "
                              f"time for nothing; warm one of those, or {w}x{h}:all")
    if compiled:
        try:
            bound = compile_shapes(options)
        except PipelineError as exc:
            raise ConfigError(f"model {model!r}: {exc}") from None
        if len(out) > bound:
            raise ConfigError(f"model {model!r}: the warm-up is {len(out)} shapes ("
                              f"{', '.join(f'{w}x{h}:{b}' for w, h, b in out)}), more than compile_shapes={bound}, "
                              f"the graphs a compiled module keeps; give the model compile_shapes={len(out)} "
                              "(SPEC,compile_shapes=N or options), or warm fewer shapes")
    return out
