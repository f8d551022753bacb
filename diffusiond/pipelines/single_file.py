"""Single ``.safetensors`` checkpoints (a model as one file, e.g. BFL's flux1-dev.safetensors), loaded through
diffusers' ``from_single_file``.

Apart from ``loaders.py`` because a file is not a pipeline: the class to serve it with is inferred from its tensor
names, and what it lacks (configs, and for a transformer-only file its text encoders and VAE) comes from elsewhere,
each of which fails in its own way and is reported as such.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import torch

from diffusiond.pipelines.base import PipelineError
from diffusiond.pipelines.diffusers_pipeline import DiffusersPipeline
from diffusiond.pipelines.load_progress import loaded
from diffusiond.pipelines.loaders import component_damaged, dtype_kwarg, dtype_kwarg_of, hub_offline
from diffusiond.pipelines.pipeline_classes import components
from diffusiond.pipelines.pipeline_classes import pipeline_class as _pipeline_class
from diffusiond.pipelines.pipeline_classes import read_index as _read_index

# Single-file checkpoint model types (diffusers' own inference) -> pipeline class to load with.
_SINGLE_FILE_CLASSES: tuple[tuple[str, str], ...] = (
    ("xl_base", "StableDiffusionXLPipeline"),
    ("playground-v2-5", "StableDiffusionXLPipeline"),
    ("v1", "StableDiffusionPipeline"),
    ("v2", "StableDiffusionPipeline"),
    ("sd3", "StableDiffusion3Pipeline"),
    ("sd35_large", "StableDiffusion3Pipeline"),
    ("sd35_medium", "StableDiffusion3Pipeline"),
    ("flux-dev", "FluxPipeline"),
    ("flux-schnell", "FluxPipeline"),
    ("ltx-video", "LTXPipeline"),
)


def _shapes(path: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors as meta tensors of their shapes: its header only, no weights, read once for both
    the class and the components it lacks."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: torch.empty(f.get_slice(k).get_shape(), device="meta") for k in f.keys()}  # noqa: SIM118
    except Exception as exc:
        raise PipelineError(f"cannot read checkpoint {str(path)!r}: {exc}; it is not a safetensors file, or one "
                            "cut short: download it again") from exc


def _single_file_class(path: Path, shapes: Mapping[str, torch.Tensor], options: Mapping[str, str]) -> type[Any]:
    """Pick the class for a checkpoint from its tensor names and shapes."""
    explicit = options.get("pipeline_class")
    if explicit:
        return _pipeline_class(explicit, "option pipeline_class")
    from diffusers.loaders.single_file_utils import infer_diffusers_model_type

    try:
        model_type = infer_diffusers_model_type(shapes)
    except Exception as exc:
        raise PipelineError(f"cannot read checkpoint {str(path)!r}: {exc}") from exc
    for prefix, class_name in _SINGLE_FILE_CLASSES:
        if model_type == prefix or model_type.startswith(prefix + "-"):
            return _pipeline_class(class_name, f"checkpoint type {model_type!r}")
    raise PipelineError(
        f"checkpoint {str(path)!r} looks like a {model_type!r} model, which diffusiond does not load from a "
        "single file; set option pipeline_class=<diffusers class> or use a diffusers folder"
    )


def load_single_file(
    path: Path, *, name: str, device: torch.device, dtype: torch.dtype, options: Mapping[str, str]
) -> DiffusersPipeline:
    """A single ``.safetensors`` checkpoint; diffusers needs the model's configs beside it (``config``)."""
    shapes = _shapes(path)
    cls = _single_file_class(path, shapes, options)
    if not hasattr(cls, "from_single_file"):
        raise PipelineError(f"diffusers cannot load {cls.__name__} from a single file; use a diffusers folder")
    kwargs: dict[str, Any] = dtype_kwarg(dtype)
    if hub_offline():
        kwargs["local_files_only"] = True
    if options.get("config"):
        kwargs["config"] = options["config"]
    if cls.__name__.startswith("StableDiffusion"):
        kwargs["safety_checker"] = None
    if options.get("config") and (Path(options["config"]) / "model_index.json").is_file():
        kwargs.update(_absent_components(path, set(shapes), Path(options["config"]), dtype, options))
    try:
        pipe = cls.from_single_file(str(path), **kwargs)
    except Exception as exc:  # conversion, config download and key mismatches raise many types
        from huggingface_hub import constants

        raise PipelineError(
            f"cannot load {cls.__name__} from single file {str(path)!r}: {type(exc).__name__}: {exc}. "
            f"diffusers needs the model's configs: from the HF cache ({constants.HF_HUB_CACHE}) or the network, "
            "or a local diffusers folder given as option config=<folder>"
        ) from exc
    return DiffusersPipeline(pipe, name=name, device=device, dtype=dtype, options=options)


def _absent_components(path: Path, keys: set[str], folder: Path, dtype: torch.dtype,
                       options: Mapping[str, str]) -> dict[str, Any]:
    """The text encoders and VAE that checkpoint ``path`` lacks (as diffusers decides it, from its tensor names
    ``keys``), read from ``config=``'s diffusers folder: diffusers looks there only for weights named
    diffusion_pytorch_model.*, and a VAE only in the file, so a file of the transformer alone (BFL's
    flux1-dev.safetensors) did not load with it. Safetensors only, unless ``allow_unsafe_weights=1``, as a
    folder's components."""
    import transformers
    from diffusers.loaders.single_file_utils import LDM_VAE_KEYS, is_clip_model_in_single_file, is_t5_in_single_file

    absent: dict[str, Any] = {}
    unsafe = options.get("allow_unsafe_weights") == "1"
    for name, (library, class_name) in components(_read_index(folder / "model_index.json")).items():
        cls = getattr(importlib.import_module(library), class_name, None) if library in ("diffusers",
                                                                                         "transformers") else None
        if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
            if is_clip_model_in_single_file(cls, keys) or is_t5_in_single_file(keys):
                continue
        elif not isinstance(cls, type) or name != "vae" or any(k.startswith(tuple(LDM_VAE_KEYS)) for k in keys):
            continue
        try:
            absent[name] = cast(Any, cls).from_pretrained(str(folder), subfolder=name,
                                                          use_safetensors=None if unsafe else True,
                                                          **dtype_kwarg_of(cls, dtype))
        except Exception as exc:  # a missing file, a truncated one, a config of another class: many types
            raise PipelineError(component_damaged(f"the {name} ({class_name}) that {path.name} lacks from "
                                                  f"config={folder}", name, folder, exc, options)) from exc
        loaded(absent[name])
    return absent
