"""Which diffusers pipeline classes diffusiond serves, and as what task: decided from the class alone (its name and
its ``__call__``'s arguments), before any weights load, so that a folder we cannot drive is refused at once with why.
What a folder's ``model_index.json`` promises is checked here too, as far as the files show it: each component's
folder there (which variant of its weights to read is pipelines/variants.py's rule, which the engine shares).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from diffusiond.pipelines.base import PipelineError, Task
from diffusiond.pipelines.edit_pipes import EDIT_CLASSES, NOT_SERVED

# Class-name fragments of pipelines that need an input image/video/mask or produce something
# other than plain pictures: they cannot serve a prompt-only request.
_REFUSED_FRAGMENTS = (
    "Img2Img",
    "Image2Image",
    "ImageToImage",
    "Inpaint",
    "ImageToVideo",
    "Image2Video",
    "VideoToVideo",
    "Video2Video",
    "I2V",
    "Control",
    "Upscale",
    "Pix2Pix",
    "Depth2Img",
    "Variation",
    "Edit",
    "Transfer",
    "LDM3D",
    "Audio",
)
# ``__call__`` arguments that mean "this pipeline needs an input besides the prompt".
_INPUT_ARGS = frozenset({"image", "mask_image", "control_image", "video", "image_embeds", "init_image", "conditions"})
# What a prompt-only pipeline we can drive (size, steps, per-step stop) must accept.
_REQUIRED_ARGS = frozenset({"prompt", "height", "width", "num_inference_steps", "callback_on_step_end"})
FRAME_ARGS = ("num_frames", "video_length")


def call_args(cls: type) -> frozenset[str]:
    """Names ``cls.__call__`` accepts; how we adapt to each pipeline's own signature."""
    try:
        return frozenset(inspect.signature(cls.__call__).parameters)
    except (TypeError, ValueError):
        return frozenset()


def task_for_class(cls: type) -> Task:
    """Decide from the class alone (before any weights load) whether and how we can serve it."""
    name = cls.__name__
    if why := next((w for fragment, w in NOT_SERVED.items() if fragment in name), None):
        raise PipelineError(f"pipeline class {name} is not served yet: {why}")
    args = call_args(cls)
    for fragments, needs, task in EDIT_CLASSES:
        if any(f in name for f in fragments) and needs <= args and _REQUIRED_ARGS - {"height", "width"} <= args:
            return task
    needs_input = sorted(_INPUT_ARGS & args)
    missing = sorted(_REQUIRED_ARGS - args)
    fragment = next((f for f in _REFUSED_FRAGMENTS if f in name), None)
    if fragment or needs_input or missing:
        why = (
            f"its name marks it as a {fragment!r} pipeline"
            if fragment
            else f"it needs inputs besides the prompt ({', '.join(needs_input)})"
            if needs_input
            else f"its __call__ lacks {', '.join(missing)}"
        )
        raise PipelineError(
            f"pipeline class {name} is not a text-to-image or text-to-video pipeline ({why}); "
            "diffusiond serves prompt-only generation: use the model's text-to-image/video variant"
        )
    if "Video" in name or any(a in args for a in FRAME_ARGS):
        return Task.TEXT_TO_VIDEO
    return Task.TEXT_TO_IMAGE


def pipeline_class(class_name: str, where: str) -> type[Any]:
    """The diffusers class named by a model_index.json, refused before any weights load."""
    import diffusers

    cls = getattr(diffusers, class_name, None) if class_name else None
    if not isinstance(cls, type):
        raise PipelineError(
            f"{where} names pipeline class {class_name!r}, which diffusers {diffusers.__version__} does not have: "
            "if it is newer, pip install -U diffusers; custom pipeline code (custom_pipeline=) is not served"
        )
    task_for_class(cls)  # raises PipelineError naming the class when we cannot serve it
    return cls


def read_index(path: Path) -> dict[str, Any]:
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise PipelineError(f"cannot read {path}: {exc}") from exc
    if not isinstance(index, dict):
        raise PipelineError(f"{path} is not a diffusers model index (not a JSON object)")
    return index


def components(index: Mapping[str, Any]) -> dict[str, list[str]]:
    """The index's components that are read from a folder of their own: [library, class], both named."""
    return {k: v for k, v in index.items() if not k.startswith("_") and isinstance(v, list) and len(v) == 2
            and all(isinstance(x, str) and x for x in v)}


def check_components(folder: Path, index: Mapping[str, Any], passed: Mapping[str, Any]) -> None:
    """Refuse a folder without a component its index names (a download cut short, files left out): diffusers
    named the model's folder instead of the component's, or, for a tokenizer, built one of two tokens that
    serves every prompt as the same unknown words. ``passed`` holds what the loader gives instead of reading
    it (the safety checker and its image processor, loaders.py's ``_load_kwargs``): no folder is needed there."""
    for name, (library, cls) in components(index).items():
        if name in passed or (folder / name).is_dir():
            continue
        raise PipelineError(f"{str(folder)!r} has no {name}/ folder, which its model_index.json names ({library} "
                            f"{cls}): the model is incomplete; {fetch_component(name)}")


def fetch_component(name: str) -> str:
    """What to do about a component folder a download left out or cut short: fetch that folder alone, as the
    rest of the model is whole and may be tens of gigabytes."""
    return f"download {name}/ again (for a hub model, `hf download ORG/NAME --include '{name}/*'`)"
