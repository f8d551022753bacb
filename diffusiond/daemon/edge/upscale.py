"""A job's ``upscale`` and ``hires`` fields: their shape, their upscalers, and the sizes they make.

Runs after ``requests.check`` and before the control images, because both fields start from the output
size the request (or the model's defaults) decided. The sizes are settled here, so the worker never
rounds one and the output limit counts what the job will really hand back; every request passes here,
so its final size is checked against its format here too, with these fields or without. Every mistake
is a 400 naming the field (``upscale.name``, ``hires.scale``, ``output_format``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

import msgspec

from diffusiond.daemon.core.jobs import JobRequest
from diffusiond.daemon.errors import OutputTooLarge, invalid, shown
from diffusiond.ipc.tensors import itemsize
from diffusiond.ipc.upscale import HiresSpec, UpscaleSpec, hires_schedule
from diffusiond.protocol import FORMATS, VIDEO_TASKS, Task

if TYPE_CHECKING:
    from diffusiond.daemon.core.engine import Engine


class UpscaleBody(msgspec.Struct, forbid_unknown_fields=True):
    """``upscale``: every output through a served upscaler; ``scale`` defaults to the model's own."""

    name: str
    scale: float | None = None


class HiresBody(msgspec.Struct, forbid_unknown_fields=True):
    """``hires``: a second, image-to-image pass at ``scale`` times the size (A1111's "hires fix")."""

    scale: float = 2.0
    strength: float = 0.5
    steps: int | None = None  # the second pass's denoising steps; the request's steps when left out
    upscaler: str | None = None  # makes the first pass's picture larger; a bicubic resize when left out


MAX_UPSCALE = 8.0
MAX_HIRES = 4.0
MAX_SIDE = 16384  # an upscaled output's side; the bytes are bounded by limits.max_output_bytes too
MAX_SCHEDULE = 1000  # diffusers' steps for the second pass: steps / strength


def _body(raw: Any, cls: type[Any], field: str) -> Any:
    if raw is None or isinstance(raw, cls):
        return raw
    try:
        return msgspec.convert(raw, cls)
    except msgspec.ValidationError as exc:
        raise invalid(f"{field}: {exc}", field=field) from None


def _number(value: float, lo: float, hi: float, field: str, low_open: bool = False) -> float:
    ok = math.isfinite(value) and (lo < value if low_open else lo <= value) and value <= hi
    if not ok:
        raise invalid(f"{field} must be {'above' if low_open else 'from'} {lo:g} {'and at most' if low_open else 'to'} "
                      f"{hi:g}, got {value!r}", field=field)
    return float(value)


def _hires(engine: Engine, body: HiresBody, model: Any, req: JobRequest) -> HiresSpec:
    d = model.capabilities
    if Task.IMAGE_TO_IMAGE.value not in d.edits:
        raise invalid(f"model {model.name!r} has no image-to-image pipeline, which a hires pass runs on; "
                      "leave out hires", field="hires")
    if req.edit is not None:
        raise invalid("hires applies to jobs made from the prompt; an edit keeps its image's size", field="hires")
    if req.trajectory is not None:
        raise invalid("hires with trajectory: the trajectory would cover one pass of two; ask for one of them",
                      field="hires")
    scale = _number(body.scale, 1.0, MAX_HIRES, "hires.scale", low_open=True)
    strength = _number(body.strength, 0.0, 1.0, "hires.strength", low_open=True)
    limits = engine.config.limits
    steps = req.steps if body.steps is None else body.steps
    if not 1 <= steps <= limits.max_steps:
        raise invalid(f"hires.steps must be from 1 to {limits.max_steps}, got {shown(steps)}", field="hires.steps")
    schedule = hires_schedule(steps, strength, flow=bool(d.flow_scheduler))  # the rule of its image-to-image
    if schedule < d.min_steps:  # a scheduler stretching its last step to shift_terminal cannot run one (sizes.py)
        raise invalid(f"hires.steps {steps} at strength {strength:g} asks model {model.name!r} for {schedule} step "
                      f"(steps / strength); it takes at least {d.min_steps}: raise hires.steps or lower hires.strength",
                      field="hires.steps")
    if schedule > MAX_SCHEDULE:
        raise invalid(f"hires.steps {steps} at strength {strength:g} asks the model for {schedule} steps (steps / "
                      f"strength); at most {MAX_SCHEDULE}: raise the strength", field="hires.strength")
    step = max(8, d.size_step)
    width, height = (max(step, round(side * scale / step) * step) for side in (req.width, req.height))
    if max(width, height) > limits.max_size:
        raise invalid(f"hires.scale {scale:g} makes {width}x{height}; the largest side a model runs at is "
                      f"{limits.max_size} (then upscale the result)", field="hires.scale")
    if body.upscaler is not None:
        engine.upscalers.resolve(body.upscaler, "hires.upscaler")
    return HiresSpec(width=width, height=height, strength=strength, steps=steps, schedule=schedule,
                     upscaler=body.upscaler)


def _upscale(engine: Engine, body: UpscaleBody, size: tuple[int, int]) -> UpscaleSpec:
    info = engine.upscalers.resolve(body.name, "upscale.name")
    scale = float(info.scale) if body.scale is None else _number(body.scale, 1.0, MAX_UPSCALE, "upscale.scale")
    width, height = (round(side * scale) for side in size)
    if max(width, height) > MAX_SIDE:
        raise invalid(f"upscale.scale {scale:g} makes {width}x{height}; the largest side is {MAX_SIDE}",
                      field="upscale.scale")
    return UpscaleSpec(name=body.name, scale=scale, width=width, height=height)


def _check_format_side(req: JobRequest) -> None:
    """Refused at admission, not after the job computed and the encoder found the side too long for its format
    (webp's 16383, libjpeg's 65500): with ``limits.max_size`` raised, a plain size is enough. The field named is
    what made the output that large, else its format; the formats offered instead are those that hold the side."""
    width, height = req.output_size
    fmt, side = FORMATS[req.output_format], max(width, height)
    if side <= fmt.max_side:
        return
    video = req.num_frames is not None
    holding = " or ".join(f.name for f in FORMATS.values() if (f.video if video else f.image) and f.max_side >= side)
    field = "upscale.scale" if req.upscale else "hires.scale" if req.hires else "output_format"
    smaller = "a smaller scale" if req.upscale or req.hires else "a smaller size"
    raise invalid(f"{fmt.name} holds at most {fmt.max_side} pixels a side and the output would be {width}x{height}: "
                  f"ask for {holding} (output_format), or {smaller}", field=field)


def attach(engine: Engine, fields: dict[str, Any], model: Any, req: JobRequest) -> JobRequest:
    """``req`` with its ``hires`` and ``upscale`` settled (unchanged when it has neither), its output's side
    checked against its format: every endpoint runs this, and nothing attached later changes the size."""
    hires_body = _body(fields.get("hires"), HiresBody, "hires")
    upscale_body = _body(fields.get("upscale"), UpscaleBody, "upscale")
    if hires_body is not None or upscale_body is not None:
        req = _settled(engine, hires_body, upscale_body, model, req)
    _check_format_side(req)
    return req


def _settled(engine: Engine, hires_body: HiresBody | None, upscale_body: UpscaleBody | None, model: Any,
             req: JobRequest) -> JobRequest:
    video = model.capabilities.task in VIDEO_TASKS or (req.edit is not None and req.edit.task is Task.IMAGE_TO_VIDEO)
    if video:
        raise invalid(f"model {model.name!r} makes videos; upscale and hires apply to images",
                      field="hires" if hires_body is not None else "upscale")
    hires = _hires(engine, hires_body, model, req) if hires_body is not None else None
    req = dataclasses.replace(req, hires=hires)
    upscale = _upscale(engine, upscale_body, req.work_size) if upscale_body is not None else None
    req = dataclasses.replace(req, upscale=upscale)
    width, height = req.output_size
    elem = itemsize(req.output_dtype)
    out_bytes = req.n * width * height * 3 * elem
    limit = engine.config.limits.max_output_bytes
    if out_bytes > limit:
        raise OutputTooLarge(
            f"the job would produce {out_bytes / 2**30:.1f} GiB of output ({req.n} x {width}x{height} x 3 x {elem} "
            f"bytes); the limit is {limit / 2**30:.1f} GiB: ask for a smaller scale or fewer outputs",
            field="upscale.scale" if upscale is not None else "hires.scale")
    return req
