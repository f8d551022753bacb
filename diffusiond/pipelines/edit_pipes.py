"""The pipelines that make something from an input image, beside a model's own: which diffusers class
serves each edit task for a family, built on the loaded weights, and what each task's call takes.

A text-to-image model also edits (image-to-image, inpainting) and an LTX or Wan 2.2 TI2V text-to-video
model also animates an image (image-to-video), through diffusers' sibling pipelines built with ``from_pipe``: they
share every component, so no weight is loaded or held twice. A folder may also name an edit pipeline as its own
class (a dedicated inpainting model, Wan's image-to-video, FLUX Kontext, Qwen-Image-Edit and its Plus): the model then
does that task only, and a request must send an image. Siblings are built with ``sibling``, not a
plain ``from_pipe``, which would cast the shared weights to float32 (its docstring says why).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import MethodType
from typing import Any

import torch

import diffusiond.pipelines.wan_i2v as wan_i2v
from diffusiond.protocol import STRENGTH_TASKS, Task

log = logging.getLogger(__name__)

# A folder's own class: name fragments, and the ``__call__`` arguments it must have for us to drive it.
# The first match wins, so the inpainting variants of instruction-edit families (FluxKontextInpaint,
# QwenImageEditInpaint) are inpainting models.
EDIT_CLASSES: tuple[tuple[tuple[str, ...], frozenset[str], Task], ...] = (
    (("Inpaint",), frozenset({"image", "mask_image", "strength"}), Task.INPAINTING),
    (("Img2Img", "Image2Image"), frozenset({"image", "strength"}), Task.IMAGE_TO_IMAGE),
    (("ImageToVideo", "Image2Video", "I2V"), frozenset({"image", "num_frames"}), Task.IMAGE_TO_VIDEO),
    (("Kontext", "QwenImageEdit"), frozenset({"image"}), Task.INSTRUCTION_EDIT),
)

# Classes that match a fragment above but whose pipelines we do not drive yet: name fragment -> why.
NOT_SERVED = {
    "QwenImageEditInpaint": "Qwen-Image-Edit's inpainting pipeline (QwenImageEditInpaintPipeline) is not driven by "
                            "diffusiond yet; serve Qwen-Image-Edit (QwenImageEditPipeline) for instruction edits, or "
                            "an inpainting model",
    "WanVACE": "Wan VACE pipelines (WanVACEPipeline) are conditioned on a control video, its masks and reference "
               "images, which diffusiond does not take yet; the Wan pipelines served are WanPipeline (Wan 2.1 T2V, "
               "Wan 2.2 TI2V) and WanImageToVideoPipeline (Wan 2.1 I2V)",
}

_AUTO_CLASSES = {Task.IMAGE_TO_IMAGE: "AutoPipelineForImage2Image", Task.INPAINTING: "AutoPipelineForInpainting"}
_EDITS_OF_FAMILY: dict[str, dict[Task, str]] = {  # what diffusers' auto classes map these families to
    "StableDiffusionPipeline": {Task.IMAGE_TO_IMAGE: "StableDiffusionImg2ImgPipeline",
                                Task.INPAINTING: "StableDiffusionInpaintPipeline"},
    "StableDiffusionXLPipeline": {Task.IMAGE_TO_IMAGE: "StableDiffusionXLImg2ImgPipeline",
                                  Task.INPAINTING: "StableDiffusionXLInpaintPipeline"},
    "StableDiffusion3Pipeline": {Task.IMAGE_TO_IMAGE: "StableDiffusion3Img2ImgPipeline",
                                 Task.INPAINTING: "StableDiffusion3InpaintPipeline"},
    "FluxPipeline": {Task.IMAGE_TO_IMAGE: "FluxImg2ImgPipeline", Task.INPAINTING: "FluxInpaintPipeline"},
    # LTX-Video's text-to-video weights are its image-to-video weights (the image conditions the first frame)
    "LTXPipeline": {Task.IMAGE_TO_VIDEO: "LTXImageToVideoPipeline"},
    "LTX2Pipeline": {Task.IMAGE_TO_VIDEO: "LTX2ImageToVideoPipeline"},  # LTX-2's too (issue 30)
    # Wan 2.2 TI2V's too, where the model has them (``_CANNOT``): the image replaces the first latent frame
    "WanPipeline": {Task.IMAGE_TO_VIDEO: "WanImageToVideoPipeline"},
}  # fmt: skip
"""Named rather than found through the auto classes, whose module imports every pipeline diffusers has:
2.8 CPU-seconds of each worker's start on a 2-core box. Image families not listed still go through the
auto classes; video families have no auto class, so only those listed animate images."""
# Families whose edits depend on the weights, not the class: why a model of the family cannot, or None.
_CANNOT: dict[str, Callable[[Any], str | None]] = {"WanPipeline": wan_i2v.takes_image}
# Edit pipelines that need mending before diffusiond's batches run on them (their modules say why).
_FIT: dict[str, Callable[[Any], Any]] = {"WanImageToVideoPipeline": wan_i2v.fit}


def edit_pipes(pipe: Any, task: Task) -> dict[Task, Any]:
    """The edit pipelines a model of ``task`` also serves, by task. A family without one is left out
    (``capabilities.edits`` then say so, and admission answers 400 naming model and task)."""
    import diffusers

    if task is not Task.TEXT_TO_IMAGE and task is not Task.TEXT_TO_VIDEO:
        return {task: _fitted(pipe)}  # a dedicated model: its one edit
    family = type(pipe).__name__
    known = _EDITS_OF_FAMILY.get(family)
    if known and family in _CANNOT and (why := _CANNOT[family](pipe)) is not None:
        log.info("%s model: no %s (%s)", family, ", ".join(t.value for t in known), why)
        return {}
    wanted = known or (_AUTO_CLASSES if task is Task.TEXT_TO_IMAGE else {})
    pipes: dict[Task, Any] = {}
    for edit, cls in wanted.items():
        try:
            pipes[edit] = _fitted(sibling(getattr(diffusers, cls), pipe))
        except (ValueError, KeyError, AttributeError, TypeError) as exc:
            log.warning("%s model: no %s pipeline (%s: %s); requests for it are refused", type(pipe).__name__,
                        edit.value, type(exc).__name__, exc)
    return pipes


def _fitted(pipe: Any) -> Any:
    """``pipe``, mended where its class needs it (``_FIT``)."""
    fit = _FIT.get(type(pipe).__name__)
    return pipe if fit is None else fit(pipe)


def edit_kwargs(task: Task, images: torch.Tensor, strength: float, args: frozenset[str], area: int,
                family: str = "") -> dict[str, Any]:
    """What the edit's diffusers call takes beside the prompt and size: the image (as a batch in
    [0, 1], or pictures where the pipeline class ``family`` reads only those) always, and the strength only
    where it means something (image-to-image, inpainting).
    Kontext would scale the output to an area of 1024² and the image to one of its preferred sizes: the
    size (``area`` pixels) is the client's, and the engine has already resized the image to it. Qwen-Image-Edit
    makes the size it is given, and shows its text encoder and transformer the picture at about 1024² pixels
    whatever that size (its design, left as it is: docs/api.md says so)."""
    kwargs: dict[str, Any] = {"image": pictures(images) if family.startswith(_PICTURE_CLASSES) else images}
    if task in STRENGTH_TASKS:
        kwargs["strength"] = strength
    if "_auto_resize" in args:
        kwargs["_auto_resize"] = False
    if "max_area" in args:
        kwargs["max_area"] = area
    if "image_crf" in args:
        # LTX-2 would re-compress its image as H.264 first (as its training did), which it does for one PIL
        # picture only, never a batch; the engine's decoded image goes in as it is (docs/models.md says so)
        kwargs["image_crf"] = 0
    return kwargs


# Edit pipelines that read their image as PIL pictures only: QwenImageEditPipeline takes ``image.size`` as a
# (width, height) pair, which a tensor's ``size`` method is not.
_PICTURE_CLASSES = ("QwenImageEdit",)


def pictures(images: torch.Tensor) -> list[Any]:
    """A batch in [0, 1] (N, C, H, W) as PIL pictures, one a request; the engine's 8-bit pixels come back as they
    were sent (the batch was made from them, divided by 255)."""
    from PIL import Image

    pixels = (images.permute(0, 2, 3, 1) * 255).round().clamp(0, 255).to(torch.uint8).cpu().numpy()
    return [Image.fromarray(p) for p in pixels]


def sibling(cls: Any, pipe: Any, **components: Any) -> Any:
    """``cls.from_pipe(pipe, ...)`` on the same modules, leaving them as they were.

    diffusers' ``from_pipe`` (0.42) ends with ``new_pipeline.to(dtype=...)`` (float32 unless told), and
    the modules it casts are the loaded model's own: building an img2img sibling of a float16 SDXL turned
    the whole model float32 (twice the memory, fp32 kernels), and casting it back cost a full round trip
    of every weight on the CPU per sibling (15-23 s for an SD 1.5-size model on a 2-core box); a
    quantized module (GGUF, bitsandbytes) refuses any cast ("Casting a quantized model to a new dtype is
    unsupported"), which left a GGUF FLUX without image-to-image, inpainting and ControlNets. A sibling
    shares modules that are already where and what they should be, so their ``to`` does nothing while
    ``from_pipe`` runs (an attribute of each instance, taken off after: nothing else sees it)."""
    modules = {id(m): m for m in (*pipe.components.values(), *components.values()) if isinstance(m, torch.nn.Module)}
    for module in modules.values():
        setattr(module, "to", MethodType(_unmoved, module))  # noqa: B010
    try:
        return cls.from_pipe(pipe, **components)
    finally:
        for module in modules.values():
            delattr(module, "to")


def _unmoved(self: Any, *_args: Any, **_kwargs: Any) -> Any:
    """A shared module's ``to`` while a sibling is built (``sibling``)."""
    return self


_IMAGE_MODULES = ("image_encoder", "feature_extractor")


def share_image_encoder(base: Any, pipe: Any) -> None:
    """Give sibling ``pipe`` the model's image encoder and its processor as they are now.

    ``from_pipe`` hands a sibling the components the model had when it was built, and these two are the
    ones that change after: an IP-Adapter registers its encoder on the model while it is in the shared
    UNet and puts the model's own back when it comes out (pipelines/ip_adapter.py). The pictures are
    encoded before the call (each by its adapter's encoder) and reach every pipeline as embeddings, so no
    sibling encodes; it must still not hold an encoder the model has let go of (an adapter's, kept alive by
    a stale reference), nor lack the one a diffusers check may look for while an adapter is in."""
    have = pipe.components
    changed = {k: getattr(base, k, None) for k in _IMAGE_MODULES
               if k in have and have[k] is not getattr(base, k, None)}
    if changed:
        pipe.register_modules(**changed)
