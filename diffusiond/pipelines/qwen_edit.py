"""Qwen-Image-Edit's processor, loaded without torchvision (issue 30).

Qwen-Image-Edit folders name ``Qwen2VLProcessor`` for their ``processor`` (Qwen2.5-VL's, which reads the input
picture for the text encoder's vision tower). transformers 5 builds that processor with a video processor too,
and Qwen2-VL's video processor exists only where torchvision is installed: without it the whole folder fails to
load ("Qwen2VLVideoProcessor requires the Torchvision library"), though the edit pipelines never send a video.
Its image processor falls back to a PIL one without torchvision. ``StillsProcessor`` is the same processor less
its video half, loaded from the same files, so a folder loads the same way with or without torchvision.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# The folder entry diffusers would load as transformers' Qwen2VLProcessor (model_index.json's "processor").
_ENTRY = ["transformers", "Qwen2VLProcessor"]


@functools.cache
def stills_processor_class() -> type[Any]:
    """``Qwen2VLProcessor`` without its video processor (built here: transformers is imported on use only)."""
    from transformers import Qwen2VLProcessor

    class StillsProcessor(Qwen2VLProcessor):
        """Its ``__init__`` names no ``video_processor``: transformers derives what a processor loads and
        checks from these names (``ProcessorMixin.get_attributes``), so nothing asks for torchvision."""

        def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None,
                     **kwargs: Any) -> None:
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    return StillsProcessor


def processor_kwargs(index: Mapping[str, Any], root: Path | None) -> dict[str, Any]:
    """``processor=`` for ``from_pretrained`` where the folder at ``root`` has a Qwen2-VL processor; nothing
    otherwise (diffusers then loads every component itself)."""
    if root is None or list(index.get("processor") or []) != _ENTRY or not (root / "processor").is_dir():
        return {}
    return {"processor": stills_processor_class().from_pretrained(str(root / "processor"))}


def stills_processor(tokenizer: Any, image: Mapping[str, Any]) -> Any:
    """A processor built in code (``random:qwen-image-edit``, the tests' tiny one): ``tokenizer`` beside a Qwen2-VL
    image processor of settings ``image``."""
    from transformers import Qwen2VLImageProcessor

    return stills_processor_class()(image_processor=Qwen2VLImageProcessor(**image), tokenizer=tokenizer)


def release_layout(folder: Path, processor: Any) -> None:
    """Make a saved pipeline's processor what the release's folder has, so that a model built in code loads the way
    a download does: ``processor/`` with the tokenizer's files and the image processor's ``preprocessor_config.json``
    (not the ``processor_config.json`` naming this module's class), and model_index.json naming transformers'
    Qwen2VLProcessor."""
    sub = folder / "processor"
    (sub / "processor_config.json").unlink(missing_ok=True)
    processor.tokenizer.save_pretrained(str(sub))
    processor.image_processor.save_pretrained(str(sub))
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "processor": _ENTRY}, indent=2, sort_keys=True))
