"""A job's ``control`` field: its shape checked here, its ControlNets against the registry, its images in the pool.

Runs after ``requests.check``, because the control images are resized to the output size, which
the request (or the model's defaults, or an edit's image) decides. With an edit (image-to-image,
inpainting) the control pictures join its image and mask in one new buffer, the job's input, and
the edit's own is closed at once. Every mistake is a 400 naming the entry and field
(``control[1].scale``); a canny request to a daemon without OpenCV is a 503 saying what to install.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import TYPE_CHECKING, Any

import msgspec

from diffusiond.daemon.core.controls import (
    MAX_CONTROLS,
    PREPROCESS,
    ControlEntry,
    ControlRegistry,
    canny_unavailable,
    cv2_missing,
    decode_controls,
)
from diffusiond.daemon.core.inputs import Source, decode_in_pool
from diffusiond.daemon.core.jobs import JobRequest
from diffusiond.daemon.errors import invalid, shown
from diffusiond.daemon.values import UNION_CLASS
from diffusiond.protocol import STRENGTH_TASKS, Task

if TYPE_CHECKING:
    from diffusiond.daemon.core.engine import Engine


class ControlBody(msgspec.Struct, forbid_unknown_fields=True):
    """One entry of ``control``: a served ControlNet, its picture, how strongly and when it steers."""

    name: str
    image: str | None = None  # base64 or a data URL
    image_path: str | None = None  # a file under --input-dir
    scale: float = 1.0
    start: float = 0.0
    end: float = 1.0
    preprocess: str = "none"
    mode: int | str | None = None  # a union ControlNet's control mode, by number or by the name serve gave it


NUMBER = re.compile(r"[0-9]{1,9}")
MAX_SCALE = 4.0  # past twice the usual 0-2 range, the control only burns the picture
# the models a ControlNet steers: text-to-image ones, and folders that are one of their edits (a
# dedicated inpainting model); which families have the pipelines is the worker's to say (pipelines/controlnet.py)
_STEERED = {Task.TEXT_TO_IMAGE.value, *(t.value for t in STRENGTH_TASKS)}


def image_source(at: str, image: str | None, image_path: str | None) -> Source:
    """An entry's image (a control's, an IP-Adapter's reference): exactly one of ``image`` (base64) and
    ``image_path`` (read under --input-dir), named by its field for the 400 that a bad one gets."""
    if (image is None) == (image_path is None):
        raise invalid(f"{at} needs exactly one of image (base64) and image_path (under --input-dir)",
                      field=f"{at}.image")
    if image is not None:
        return Source(field=f"{at}.image", b64=image)
    return Source(field=f"{at}.image_path", path=image_path)


def check_scale(at: str, scale: float, top: float) -> None:
    if not (math.isfinite(scale) and 0.0 <= scale <= top):
        raise invalid(f"{at}.scale must be from 0 to {top:g}, got {shown(scale)}", field=f"{at}.scale")


def plan(raw: list[Any]) -> list[ControlEntry]:
    """The entries' shape: an image each, scale and step range in bounds, a known preprocess."""
    if len(raw) > MAX_CONTROLS:
        raise invalid(f"control has {len(raw)} entries; at most {MAX_CONTROLS} ControlNets act at once",
                      field="control")
    entries: list[ControlEntry] = []
    for i, body in enumerate(raw):
        b = body if isinstance(body, ControlBody) else msgspec.convert(body, ControlBody)
        at = f"control[{i}]"
        source = image_source(at, b.image, b.image_path)
        check_scale(at, b.scale, MAX_SCALE)
        for name, value in (("start", b.start), ("end", b.end)):
            if not (math.isfinite(value) and 0.0 <= value <= 1.0):
                raise invalid(f"{at}.{name} is a fraction of the steps, from 0 to 1; got {shown(value)}",
                              field=f"{at}.{name}")
        if b.start >= b.end:
            raise invalid(f"{at}.start ({b.start:g}) must be below {at}.end ({b.end:g}): the ControlNet acts "
                          "between them", field=f"{at}.start")
        if b.preprocess not in PREPROCESS:
            raise invalid(f"{at}.preprocess {b.preprocess[:40]!r} is not one of {', '.join(PREPROCESS)}",
                          field=f"{at}.preprocess")
        if any(e.name == b.name for e in entries):
            raise invalid(f"ControlNet {b.name[:64]!r} is named twice in control; give each once",
                          field=f"{at}.name")
        # a number written as text (a form's fields are text) is that number: a mode's name is never one
        number, named = (int(b.mode), None) if isinstance(b.mode, str) and NUMBER.fullmatch(b.mode) else \
            (None, b.mode) if isinstance(b.mode, str) else (b.mode, None)
        entries.append(ControlEntry(name=b.name, source=source, scale=b.scale, start=b.start, end=b.end,
                                    preprocess=b.preprocess, mode=number, mode_name=named))
    return entries


def check_modes(entries: list[ControlEntry], registry: ControlRegistry) -> list[ControlEntry]:
    """The entries with each mode a number in its ControlNet's range. A union ControlNet needs a mode
    (diffusers would fail mid-compute without one), given by number or by a name serve's ``modes=``
    gave it; a single-mode one takes none. SDXL's union ControlNets have pipelines of their own, so
    they run with other union ControlNets only."""
    checked: list[ControlEntry] = []
    for i, e in enumerate(entries):
        count, at = registry.modes.get(e.name, 0), f"control[{i}].mode"
        names = registry.mode_names.get(e.name, ())
        listed = f": {', '.join(names)}" if names else ""
        if e.mode is None and e.mode_name is None and count:
            raise invalid(f"ControlNet {e.name!r} is a union ControlNet with {count} control modes{listed}; choose "
                          f"one with {at} (0 to {count - 1}{', or its name' if names else ''})", field=at)
        if (e.mode is not None or e.mode_name is not None) and not count:
            raise invalid(f"ControlNet {e.name!r} has a single control mode; leave out {at}", field=at)
        if e.mode_name is not None:
            if not names:
                raise invalid(f"{at} {e.mode_name[:40]!r}: ControlNet {e.name!r} names no modes, so give its mode "
                              f"by number, 0 to {count - 1} (the model card says which is which; serve "
                              f"--controlnet {e.name}=PATH,modes=NAME:NAME:... names them)", field=at)
            if e.mode_name not in names:
                raise invalid(f"{at} {e.mode_name[:40]!r} is not a mode of ControlNet {e.name!r}; its modes are "
                              f"{', '.join(names)} (or their numbers, 0 to {count - 1})", field=at)
            e = dataclasses.replace(e, mode=names.index(e.mode_name), mode_name=None)
        elif e.mode is not None and not 0 <= e.mode < count:
            raise invalid(f"{at} must be from 0 to {count - 1} (ControlNet {e.name!r} has {count} control "
                          f"modes{listed}), got {shown(e.mode)}", field=at)
        checked.append(e)
    unions = [e.name for e in checked if registry.classes.get(e.name) == UNION_CLASS]
    if unions and len(unions) != len(checked):
        raise invalid(f"ControlNet {unions[0]!r} is an SDXL union ControlNet, which runs with other union "
                      "ControlNets only; send the others in another request", field="control")
    return checked


async def attach(engine: Engine, fields: dict[str, Any], model: Any, req: JobRequest) -> JobRequest:
    """``req`` with its decoded control images (unchanged when it has none)."""
    raw = fields.get("control")
    if not raw:
        return req
    entries = plan(list(raw))
    if model.capabilities.task not in _STEERED:
        raise invalid(f"model {model.name!r} does {model.capabilities.task}; ControlNets steer text-to-image "
                      "models, their image-to-image and their inpainting", field="control")
    if req.edit is not None and req.edit.task not in STRENGTH_TASKS:
        raise invalid(f"this request is {req.edit.task.value}; ControlNets act with image-to-image and "
                      "inpainting edits (and text-to-image)", field="control")
    engine.check_controls(model.name, [e.name for e in entries])
    entries = check_modes(entries, engine.controls)
    canny = next((i for i, e in enumerate(entries) if e.preprocess == "canny"), None)
    if canny is not None and cv2_missing():
        raise canny_unavailable(f"control[{canny}].preprocess")
    cfg = engine.config
    joined = req.edit.buffer if req.edit is not None else None  # the edit's image and mask join the pictures
    work = functools.partial(decode_controls, entries, width=req.width, height=req.height, limits=cfg.limits,
                             input_dir=cfg.input_dir, joined=joined)
    decoded = await decode_in_pool(engine.executor, work)
    if joined is not None:
        joined.close()  # the edit's close() is then a no-op; the job closes the new one with the rest
    return dataclasses.replace(req, control=decoded,
                               controls=tuple((e.name, e.scale, e.start, e.end, e.preprocess, e.mode) for e in entries))
