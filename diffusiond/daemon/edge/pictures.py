"""A job's ``images`` field: one edit from several input pictures (Qwen-Image-Edit Plus, issue 30).

Apart from ``edits.py`` because it has rules of its own: only a model whose capabilities take more than one
picture an edit (``max_input_images``) accepts it, within that count, and never beside ``image`` or a mask.
Each entry is an image in the forms ``image`` takes (base64 or a data URL as a bare string, or
``{"image": ...}`` / ``{"image_path": ...}`` as the other image-carrying fields' entries are), named
``images[i]`` in a 400. The prompt names them "Picture 1", "Picture 2", ... in order; the LAST one is the
edit's image (resized to the output size, which is its own unless the request names one, as ``image``'s
is: the pipeline, too, takes its output's shape from its last picture), and the earlier ones travel at their
own sizes (``inputs.decode_edit``).
"""

from __future__ import annotations

from typing import Any

import msgspec

from diffusiond.daemon.core.inputs import Source
from diffusiond.daemon.edge.controls import image_source
from diffusiond.daemon.edge.sizes import ModelLike
from diffusiond.daemon.errors import invalid


class PictureBody(msgspec.Struct, forbid_unknown_fields=True):
    """One entry of ``images`` as an object: exactly one of ``image`` (base64) and ``image_path``."""

    image: str | None = None
    image_path: str | None = None


def plan(fields: dict[str, Any], model: ModelLike) -> tuple[dict[str, Any], list[Source]]:
    """``fields`` with the last picture as the edit's image (``image_source``, for ``edits.plan_edit``), and the
    earlier ones' sources; ``fields`` as they are, and none, when the request sends no ``images``."""
    raw = fields.get("images")
    if raw is None:
        return fields, []
    top = model.capabilities.max_input_images
    if top <= 1:
        raise invalid(f"model {model.name!r} takes one input image; send it as image (images is for models "
                      "that edit from several: GET /v1/models lists each one's max_input_images)", field="images")
    if not isinstance(raw, list) or not raw:
        raise invalid("images must be a list of 1 to "
                      f"{top} images (base64 or data URL strings, or {{\"image_path\": ...}} objects)", field="images")
    if len(raw) > top:
        raise invalid(f"images has {len(raw)} entries; model {model.name!r} takes at most {top} input images an "
                      "edit: send fewer", field="images")
    for other in ("image", "image_path", "image_bytes", "mask", "mask_path", "mask_bytes"):
        if fields.get(other) is not None:
            what = "send image or images, not both" if other.startswith("image") else \
                "a mask does not apply to an edit from several images: leave it out"
            raise invalid(what, field=other.removesuffix("_bytes"))
    sources = [_source(i, entry) for i, entry in enumerate(raw)]
    return {**fields, "image_source": sources[-1]}, sources[:-1]


def _source(i: int, entry: Any) -> Source:
    at = f"images[{i}]"
    if isinstance(entry, str):
        return Source(field=at, b64=entry)
    b = entry if isinstance(entry, PictureBody) else msgspec.convert(entry, PictureBody)
    return image_source(at, b.image, b.image_path)
