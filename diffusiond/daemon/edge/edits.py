"""An edit's plan: its sources, task and strength, checked against the model before any pixel is decoded.

Apart from ``requests.py`` because an edit has rules of its own, shared by ``/v1/jobs`` (``image`` in JSON)
and ``/v1/images/edits`` (a multipart form): which task an image without a mask asks of a model, which
models can do it, and whether ``strength`` applies. ``bodies.decode_edit`` decodes the image after this.
"""

from __future__ import annotations

from typing import Any

from diffusiond.daemon.config import Limits
from diffusiond.daemon.core.inputs import Source
from diffusiond.daemon.edge.sizes import ModelLike, check_side
from diffusiond.daemon.errors import invalid
from diffusiond.protocol import STRENGTH_TASKS, Task


def _unmasked_task(own: str, edits: tuple[str, ...]) -> Task:
    """What an image without a mask asks of a model: its own task when that takes an image (an
    instruction edit, image-to-video), else the edit it offers (image-to-video of a video model; a
    video model without it is told it cannot do image-to-video, not image-to-image)."""
    for task in (Task.INSTRUCTION_EDIT, Task.IMAGE_TO_VIDEO):
        if own == task.value or task.value in edits:
            return task
    return Task.IMAGE_TO_VIDEO if own == Task.TEXT_TO_VIDEO.value else Task.IMAGE_TO_IMAGE


def plan_edit(
    req: dict[str, Any], model: ModelLike, limits: Limits, *, image_field: str = "image", mask_field: str = "mask",
    size_field: str | None = None,
) -> tuple[Source, Source | None, Task, float] | None:
    """The sources, task and strength of an edit (None: not an edit), checked against the model
    before any pixel is decoded. ``req`` has ``image``/``image_path``/``mask``/``mask_path`` as
    base64 text or paths, or ``image_bytes``/``mask_bytes`` (multipart uploads)."""
    def source(field: str, path_field: str, raw: str) -> Source | None:
        if req.get(raw) is not None:
            return Source(field, data=req[raw])
        b64, path = req.get(field), req.get(path_field)
        if b64 is not None and path is not None:
            raise invalid(f"send {field} or {path_field}, not both", field=field)
        if b64 is not None:
            return Source(field, b64=b64)
        if path is not None:
            return Source(path_field, path=path)
        return None

    image = req.get("image_source") or source(image_field, "image_path", "image_bytes")  # images' last (pictures.py)
    mask = source(mask_field, "mask_path", "mask_bytes")
    if image is None:
        if mask is not None:
            raise invalid("a mask needs an image to apply to: send image too", field=mask.field)
        return None
    d = model.capabilities
    task = Task.INPAINTING if mask is not None else _unmasked_task(d.task, d.edits)
    if task.value not in d.edits and d.task != task.value:
        if mask is None and Task.INPAINTING.value in (d.task, *d.edits):  # the fix is a mask, not another model
            raise invalid(f"model {model.name!r} cannot do {task.value} from an image alone; it inpaints: send a mask "
                          "with the image (mask; --mask FILE on the CLI), or pick a model that edits without one",
                          field="mask")
        others = [e for e in d.edits if e != d.task]  # a dedicated inpainting model: said once
        can = f"it does {d.task}" + (f"; also {', '.join(others)}" if others else "")
        raise invalid(f"model {model.name!r} cannot do {task.value} ({can}); "
                      "pick a model that has it (GET /v1/models lists each model's tasks)", field="model")
    strength = req.get("strength")
    if task not in STRENGTH_TASKS:
        if strength is not None:
            raise invalid(f"strength does not apply to {task.value} (model {model.name!r}); leave it out",
                          field="strength")
        strength = 1.0
    elif strength is None:
        strength = 1.0 if task == Task.INPAINTING else 0.8  # diffusers' own defaults
    if not 0 < strength <= 1:
        raise invalid(f"strength must be in (0, 1] (0 keeps the image, 1 repaints it all), got {strength:g}",
                      field="strength")
    if req.get("num_frames") is not None and task is not Task.IMAGE_TO_VIDEO:
        raise invalid("num_frames does not apply to image edits", field="num_frames")
    size_field = size_field or req.get("size_field")
    for side in ("width", "height"):  # before the image is resized to them
        if req.get(side) is not None:
            check_side(side, req[side], limits, size_field, model)
    return image, mask, task, float(strength)
