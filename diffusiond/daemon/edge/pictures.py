"""A job's ``images`` field: one edit from several input pictures (Qwen-Image-Edit Plus, issue 30).

Apart from ``edits.py`` because it has rules of its own: only a model whose capabilities take more than one
picture an edit (``max_input_images``) accepts it, within that count, and never beside ``image`` or a mask.
Each entry is an image in the forms ``image`` takes (base64 or a data URL as a bare string, or
``{"image": ...}`` / ``{"image_path": ...}`` as the other image-carrying fields' entries are), named
``images[i]`` in a 400. The prompt names them "Picture 1", "Picture 2", ... in order; the LAST one is the
edit's image (resized to the output size, which is its own unless the request names one, as ``image``'s
is: the pipeline, too, takes its output's shape from its last picture), and the earlier ones travel at their
own sizes (``inputs.decode_edit``).

``/v1/images/edits`` sends its several ``image[]`` files here too, as OpenAI's edits endpoint reads them: one
edit's pictures (``form_pictures``), named ``image[i]``; the count is checked before anything is decoded or
admitted, so a refused form leaves no job behind.
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


FORM_FIELD = "image[]"
"""What the edits form's several pictures are called in a refusal (``images_field``): their entries are
``image[0]``, ``image[1]``, ..."""


def form_pictures(images: list[tuple[str, bytes]], mask: bytes | None, model: ModelLike) -> dict[str, Any]:
    """The edits form's image files as the fields ``/v1/jobs`` reads: one is ``image`` (with the mask); several
    are one edit's ``images``, as OpenAI's endpoint reads them (gpt-image-1's reference pictures), on a model that
    takes several. A model that takes one is told so rather than given one unrelated edit per file, which is
    what this endpoint did before. Counted here, before any picture is decoded or any job
    admitted."""
    name = model.name
    if len(images) == 1:
        return {"image_bytes": images[0][1], "mask_bytes": mask}
    top = model.capabilities.max_input_images
    if top <= 1:
        raise invalid(f"the form sends {len(images)} images ({FORM_FIELD}); model {name!r} takes one input image "
                      f"an edit: send one. Several {FORM_FIELD} are one edit's pictures, as on OpenAI's endpoint, for "
                      "a model whose max_input_images is over 1 (GET /v1/models); to edit each picture with this "
                      "model, send one request per picture", field=FORM_FIELD)
    if len(images) > top:
        raise invalid(f"the form sends {len(images)} images ({FORM_FIELD}); model {name!r} takes at most {top} "
                      "input images an edit: send fewer", field=FORM_FIELD)
    return {"images": [data for _, data in images], "images_field": FORM_FIELD, "mask_bytes": mask}


def plan(fields: dict[str, Any], model: ModelLike) -> tuple[dict[str, Any], list[Source]]:
    """``fields`` with the last picture as the edit's image (``image_source``, for ``edits.plan_edit``), and the
    earlier ones' sources; ``fields`` as they are, and none, when the request sends no ``images``."""
    raw = fields.get("images")
    if raw is None:
        return fields, []
    field = fields.get("images_field", "images")
    top = model.capabilities.max_input_images
    if top <= 1:
        raise invalid(f"model {model.name!r} takes one input image; send it as image (images is for models "
                      "that edit from several: GET /v1/models lists each one's max_input_images)", field=field)
    if not isinstance(raw, list) or not raw:
        raise invalid("images must be a list of 1 to "
                      f"{top} images (base64 or data URL strings, or {{\"image_path\": ...}} objects)", field=field)
    if len(raw) > top:
        raise invalid(f"images has {len(raw)} entries; model {model.name!r} takes at most {top} input images an "
                      "edit: send fewer", field=field)
    for other in ("image", "image_path", "image_bytes", "mask", "mask_path", "mask_bytes"):
        if fields.get(other) is not None:
            what = "send image or images, not both" if other.startswith("image") else \
                "a mask does not apply to an edit from several images: leave it out"
            raise invalid(what, field=other.removesuffix("_bytes"))
    sources = [_source(f"{field.removesuffix('[]')}[{i}]", entry) for i, entry in enumerate(raw)]
    return {**fields, "image_source": sources[-1]}, sources[:-1]


def _source(at: str, entry: Any) -> Source:
    if isinstance(entry, bytes):  # a form's file
        return Source(field=at, data=entry)
    if isinstance(entry, str):
        return Source(field=at, b64=entry)
    b = entry if isinstance(entry, PictureBody) else msgspec.convert(entry, PictureBody)
    return image_source(at, b.image, b.image_path)
