"""An output's sides and its steps: the ``size`` spelling ("512x512"), and the checks of width, height and
steps against the limits and what the model declares.

Apart from ``requests.py`` because more than admission needs them: an edit's sides are checked before its
image is decoded (``edits.py``) and the decoder resizes to the same step and floor (``bodies.py``), the
OpenAI form reads the same spelling (``forms.py``), and a model's JSON shows its smallest side (``views.py``).
A model may ask more than the limits (LTX a multiple of 32, LTX-2 at least 64; two steps where its scheduler
stretches the last one): the refusal names the nearest values it takes instead of failing while computing.
"""

from __future__ import annotations

import re
from typing import Any, Protocol

from diffusiond.daemon.config import Limits
from diffusiond.daemon.errors import invalid, shown
from diffusiond.ipc.messages import Capabilities
from diffusiond.protocol import too_few_steps

SIZE = re.compile(r"^(\d{1,5})x(\d{1,5})$")


class ModelLike(Protocol):
    """What admission needs of a model: its name and what it can make. The engine's ``Model``
    fits; tests can pass anything with these two attributes."""

    @property
    def name(self) -> str: ...

    @property
    def capabilities(self) -> Capabilities: ...


def sized(req: dict[str, Any]) -> dict[str, Any]:
    """``size`` ("512x512") on /v1/jobs -> width and height, so both endpoints take the same
    spelling; given with width or height that disagree, a 400 naming ``size`` (which one was
    meant cannot be guessed). Later errors about the sides name ``size``, the field sent."""
    size = req.get("size")
    if size is None:
        return req
    m = SIZE.match(size) if isinstance(size, str) else None
    if not m:
        raise invalid(f"size must look like 512x512 (width x height), got {size!r}", field="size")
    width, height = int(m.group(1)), int(m.group(2))
    for name, value in (("width", width), ("height", height)):
        if req.get(name) is not None and req[name] != value:
            raise invalid(f"size {size} and {name} {req[name]} disagree; send size, or width and height",
                          field="size")
    return {**req, "width": width, "height": height, "size_field": "size"}


def side_step(model: ModelLike | None) -> int:
    """The multiple each side of an output must be: 8, or the model's own ``size_step`` (LTX 32)."""
    return max(8, model.capabilities.size_step) if model is not None else 8


def side_floor(model: ModelLike | None, limits: Limits) -> int:
    """The smallest side of an output: the limits', or the model's own ``min_size`` where larger (LTX-2 64)."""
    return max(limits.min_size, model.capabilities.min_size) if model is not None else limits.min_size


def check_side(name: str, v: int, limits: Limits, size_field: str | None = None,
               model: ModelLike | None = None) -> None:
    """A side within the limits and a multiple of 8; and of the model's own ``size_step`` (LTX 32), at least its
    ``min_size``, naming the nearest sides it makes, as frame counts do, instead of failing while computing."""
    step, floor = side_step(model), side_floor(model, limits)
    inside = floor <= v <= limits.max_size
    if inside and v % step == 0:
        return
    if model is not None and limits.min_size <= v < floor:
        raise invalid(f"{name} must be at least {floor} for {model.name!r} (the smallest side it makes), got {v}",
                      field=size_field or name)
    if not inside or v % 8 or model is None:
        raise invalid(f"{name} must be a multiple of {step} between {floor} and {limits.max_size}, got {v}",
                      field=size_field or name)
    lower = v // step * step
    near = " or ".join(str(s) for s in (lower, lower + step) if floor <= s <= limits.max_size)
    raise invalid(f"{name} must be a multiple of {step} for {model.name!r}; use {near or 'another size'}, got {v}",
                  field=size_field or name)


INHERITED_PIXELS = 4
"""An edit that sends no size runs at its picture's: up to this many times the model's default pixel count
(2048x2048 on a 1024x1024 model, 256x256 on tiny). Past it one picture (a 4000x4000 PNG is 75 KB) held a
worker in a forward for longer than any deadline, and a deadline cannot stop a forward; a
larger output stays one ``size`` away, up to ``limits.max_size``."""


def check_inherited(width: int, height: int, field: str, model: ModelLike, limits: Limits) -> None:
    """Refuse an edit whose size comes from its picture when that is over ``INHERITED_PIXELS`` times the model's
    default pixel count, naming the picture and a ``size`` of its aspect ratio at the model's pixel count."""
    d = model.capabilities
    bound = INHERITED_PIXELS * d.width * d.height
    if width * height <= bound:
        return
    step, floor = side_step(model), side_floor(model, limits)
    scale = (d.width * d.height / (width * height)) ** 0.5
    w, h = (max(floor, int(side * scale) // step * step) for side in (width, height))
    raise invalid(f"{field} is {width}x{height} and the request sends no size, so the edit would run at that size: "
                  f"over {INHERITED_PIXELS} times the pixels of model {model.name!r}'s {d.width}x{d.height}, which "
                  f"an edit takes from its picture only up to {bound} pixels. Send size (e.g. {w}x{h}, the picture's "
                  f"aspect ratio at the model's size; --size on the CLI) to resize it, or a smaller picture",
                  field=field)


def check_steps(field: str, steps: Any, model: ModelLike | None, max_steps: int) -> None:
    """Steps within the limits, and at least the model's ``min_steps``: a scheduler that stretches its last sigma
    to ``shift_terminal`` (``Capabilities.min_steps`` names the families) divides by zero over one step and makes
    an image of NaN."""
    low = model.capabilities.min_steps if model is not None else 1
    if steps is None or low <= steps <= max_steps:
        return
    if model is not None and 1 <= steps < low:
        raise invalid(too_few_steps(field, steps, model.name, low), field=field)
    raise invalid(f"{field} must be between {low} and {max_steps}, got {shown(steps)}", field=field)
