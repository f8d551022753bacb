"""``load_pipeline``: turn a model spec from the config or the CLI into a ready ``Pipeline``.

A spec is one string so that a config file, a CLI flag and an HTTP field can all name a model the
same way. Resolution is explicit and ordered, and every failure is a ``PipelineError`` whose message
says what was tried and what to do, because a daemon that cannot load its model is only as useful
as the line it logs. Weights load from safetensors unless ``allow_unsafe_weights=1`` (no pickle).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from diffusiond.pipelines.base import Pipeline, PipelineError

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
# Every option any loader understands; others are refused so a typo does not pass silently.
KNOWN_OPTIONS = frozenset(
    {
        "allow_unsafe_weights",  # "1": allow pickle-based weights (.bin) when no safetensors exist
        "cpu_offload",  # "1": enable_model_cpu_offload (accelerator devices only)
        "vae_tiling",  # "1": decode large images in tiles
        "vae_slicing",  # "1": decode a batch one image at a time
        "pipeline_class",  # single-file checkpoints: diffusers class to load it with
        "config",  # single-file checkpoints: local diffusers folder or hub id with the configs
        "local_files_only",  # "1": hub ids: never touch the network, only the HF cache
        "compute_ms",  # synthetic: device work per batch
        "task",  # synthetic: "image" or "video"
        "matrix",  # synthetic: side of the square matrices of the workload
        "save",  # random:<preset>: "0" builds on the device and skips the save/load round trip
    }
)
ACCEPTED_FORMS = (
    "'tiny' or 'tiny-video' (embedded random-weight models, no download), "
    "'random:<preset>' (a real architecture at full size with random weights, for benchmarks: "
    "random:sd15, random:sdxl, random:flux-dev, random:wan-1.3b), "
    "'synthetic' or 'synthetic:compute_ms=40,task=video' (no diffusers, for benchmarks), "
    "a local folder with a diffusers model_index.json, "
    "a path to a single-file '.safetensors' checkpoint, "
    "or a Hugging Face hub id 'org/name' already in the HF cache"
)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_PICKLE_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin")
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


def parse_dtype(dtype: str) -> torch.dtype:
    """Map the config's dtype string; an unknown one is an error, never a silent float32."""
    try:
        return DTYPES[dtype]
    except KeyError:
        raise PipelineError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}") from None


def parse_device(device: str) -> torch.device:
    """Validate the device early: failing at load is better than failing at the first request."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise PipelineError(f"bad device {device!r}: {exc}") from exc
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise PipelineError(f"device {device!r} requested but CUDA is not available in this process")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise PipelineError(f"device {device!r} does not exist ({torch.cuda.device_count()} CUDA devices)")
    return dev


def load_pipeline(
    spec: str,
    *,
    name: str | None = None,
    device: str = "cpu",
    dtype: str = "float32",
    options: Mapping[str, str] | None = None,
) -> Pipeline:
    """Resolve ``spec`` (see ``ACCEPTED_FORMS``) and return a pipeline on ``device``."""
    torch_dtype = parse_dtype(dtype)
    dev = parse_device(device)
    opts = dict(options or {})
    spec = spec.strip()
    if spec == "synthetic" or spec.startswith("synthetic:"):
        from diffusiond.pipelines.synthetic import SyntheticPipeline, parse_spec_options

        opts = {**parse_spec_options(spec), **opts}
        _check_options(opts)
        return SyntheticPipeline(name=name or "synthetic", device=dev, dtype=torch_dtype, options=opts)
    _check_options(opts)
    if spec == "tiny":
        from diffusiond.pipelines.tiny import ensure_tiny

        pipe = load_folder(ensure_tiny(), name=name or "tiny", device=dev, dtype=torch_dtype, options=opts)
        pipe.defaults = {"width": 128, "height": 128, "steps": 4, "guidance": 5.0}  # quick on a CPU
        return pipe
    if spec == "tiny-video":
        from diffusiond.pipelines.tiny_video import DEFAULTS, ensure_tiny_video

        pipe = load_folder(ensure_tiny_video(), name=name or "tiny-video", device=dev, dtype=torch_dtype, options=opts)
        pipe.defaults = {**pipe.defaults, **DEFAULTS}  # keeps the adapter's num_frames_step
        return pipe
    if spec.startswith("random:"):
        from diffusiond.pipelines.presets import load_preset
        from diffusiond.pipelines.synthetic import parse_spec_options

        key, _, rest = spec.removeprefix("random:").partition(",")  # random:wan-1.3b,save=0
        opts = {**parse_spec_options(":" + rest), **opts}
        _check_options(opts)
        return load_preset(key, name=name, device=dev, dtype=torch_dtype, options=opts)
    if not spec:
        raise PipelineError(f"empty model spec; accepted: {ACCEPTED_FORMS}")
    path = Path(spec).expanduser()
    if path.is_dir():
        return load_folder(path, name=name or path.name, device=dev, dtype=torch_dtype, options=opts)
    lower = spec.lower()
    if lower.endswith(".safetensors"):
        if not path.is_file():
            raise PipelineError(f"checkpoint file {spec!r} does not exist")
        return load_single_file(path, name=name or path.stem, device=dev, dtype=torch_dtype, options=opts)
    if lower.endswith(_PICKLE_SUFFIXES):
        raise PipelineError(
            f"{spec!r} is a pickle-based checkpoint; diffusiond loads only safetensors "
            "(convert it, or use a diffusers folder)"
        )
    if _HUB_ID.match(spec):
        return load_hub(spec, name=name or spec, device=dev, dtype=torch_dtype, options=opts)
    raise PipelineError(f"unrecognised model spec {spec!r}; accepted: {ACCEPTED_FORMS}")


def _dtype_kwarg(dtype: torch.dtype) -> dict[str, torch.dtype]:
    """diffusers renamed ``torch_dtype`` to ``dtype`` (the old name warns); pass whichever it wants."""
    from diffusers.utils import deprecation_utils

    return {"dtype" if hasattr(deprecation_utils, "_resolve_dtype") else "torch_dtype": dtype}


def _hub_offline() -> bool:
    """Read at call time: the hub libraries read HF_HUB_OFFLINE once, at import."""
    from huggingface_hub import constants

    flag = os.environ.get("HF_HUB_OFFLINE", "").strip().upper()
    return flag in {"1", "ON", "YES", "TRUE"} or bool(constants.HF_HUB_OFFLINE)


def _check_options(opts: Mapping[str, str]) -> None:
    unknown = sorted(set(opts) - KNOWN_OPTIONS)
    if unknown:
        raise PipelineError(f"unknown model option(s) {', '.join(unknown)}; known: {', '.join(sorted(KNOWN_OPTIONS))}")


def _pipeline_class(class_name: str, where: str) -> type:
    """The diffusers class named by a model_index.json, refused before any weights load."""
    import diffusers

    from diffusiond.pipelines.diffusers_pipeline import task_for_class

    cls = getattr(diffusers, class_name, None) if class_name else None
    if not isinstance(cls, type):
        raise PipelineError(
            f"{where} names pipeline class {class_name!r}, which diffusers {diffusers.__version__} does not have "
            "(custom or newer pipeline?)"
        )
    task_for_class(cls)  # raises PipelineError naming the class when we cannot serve it
    return cls


def _read_index(path: Path) -> dict[str, Any]:
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise PipelineError(f"cannot read {path}: {exc}") from exc
    if not isinstance(index, dict):
        raise PipelineError(f"{path} is not a diffusers model index (not a JSON object)")
    return index


def _load_kwargs(index: Mapping[str, Any], dtype: torch.dtype, opts: Mapping[str, str]) -> dict[str, Any]:
    """from_pretrained arguments shared by folder and hub loads."""
    kwargs: dict[str, Any] = _dtype_kwarg(dtype)
    # safetensors only, unless explicitly allowed: .bin weights are pickles and can run code.
    kwargs["use_safetensors"] = None if opts.get("allow_unsafe_weights") == "1" else True
    if "safety_checker" in index:
        # Skip loading a component we would discard anyway.
        kwargs["safety_checker"] = None
        kwargs["requires_safety_checker"] = False
    return kwargs


def _wrap(pipe: Any, *, name: str, device: torch.device, dtype: torch.dtype, opts: Mapping[str, str]) -> Pipeline:
    from diffusiond.pipelines.diffusers_pipeline import DiffusersPipeline

    return DiffusersPipeline(pipe, name=name, device=device, dtype=dtype, options=opts)


def load_folder(
    path: Path, *, name: str, device: torch.device, dtype: torch.dtype, options: Mapping[str, str]
) -> Pipeline:
    """A local diffusers folder (``save_pretrained`` layout); the path ``tiny`` takes too."""
    index_path = path / "model_index.json"
    if not index_path.is_file():
        raise PipelineError(f"folder {str(path)!r} has no model_index.json; it is not a diffusers pipeline folder")
    index = _read_index(index_path)
    cls = _pipeline_class(str(index.get("_class_name", "")), str(index_path))
    try:
        pipe = cls.from_pretrained(str(path), **_load_kwargs(index, dtype, options))  # type: ignore[attr-defined]
    except (OSError, ValueError, RuntimeError, ImportError) as exc:
        hint = ""
        if "safetensors" in str(exc) and options.get("allow_unsafe_weights") != "1":
            hint = " (only safetensors weights load by default; allow_unsafe_weights=1 permits .bin)"
        raise PipelineError(f"cannot load {cls.__name__} from {str(path)!r}: {exc}{hint}") from exc
    return _wrap(pipe, name=name, device=device, dtype=dtype, opts=options)


def load_hub(
    repo_id: str, *, name: str, device: torch.device, dtype: torch.dtype, options: Mapping[str, str]
) -> Pipeline:
    """A hub id, through the normal HF cache; the daemon never hides a failed download."""
    from huggingface_hub import constants, try_to_load_from_cache

    cache = constants.HF_HUB_CACHE
    cached_index = try_to_load_from_cache(repo_id, "model_index.json")
    not_cached = (
        f"model {repo_id!r} is not in the Hugging Face cache ({cache}) and could not be downloaded; "
        f"download it first, e.g. `hf download {repo_id}` (older hubs: `huggingface-cli download {repo_id}`), "
        "or pass a local folder"
    )
    index: dict[str, Any] = {}
    if isinstance(cached_index, str):  # refuse an unservable class before fetching any weights
        index = _read_index(Path(cached_index))
        _pipeline_class(str(index.get("_class_name", "")), f"{repo_id}/model_index.json")
    local_only = options.get("local_files_only") == "1" or _hub_offline()
    if not isinstance(cached_index, str) and local_only:
        raise PipelineError(not_cached)
    from diffusers import DiffusionPipeline

    kwargs = _load_kwargs(index, dtype, options)
    if local_only:
        kwargs["local_files_only"] = True
    try:
        pipe = DiffusionPipeline.from_pretrained(repo_id, **kwargs)
    except Exception as exc:  # network errors come in many types (requests, httpx, hub errors)
        if not isinstance(cached_index, str):
            raise PipelineError(f"{not_cached}: {type(exc).__name__}: {exc}") from exc
        raise PipelineError(f"cannot load {repo_id!r} from the HF cache ({cache}): {exc}") from exc
    from diffusiond.pipelines.diffusers_pipeline import task_for_class

    task_for_class(type(pipe))
    return _wrap(pipe, name=name, device=device, dtype=dtype, opts=options)


def _single_file_class(path: Path, options: Mapping[str, str]) -> type:
    """Pick the class for a checkpoint from its tensor names and shapes (read lazily, no weights)."""
    explicit = options.get("pipeline_class")
    if explicit:
        return _pipeline_class(explicit, "option pipeline_class")
    from diffusers.loaders.single_file_utils import infer_diffusers_model_type
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            shapes = {k: torch.empty(f.get_slice(k).get_shape(), device="meta") for k in f.keys()}  # noqa: SIM118
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
) -> Pipeline:
    """A single ``.safetensors`` checkpoint; diffusers needs the model's configs beside it (``config``)."""
    cls = _single_file_class(path, options)
    if not hasattr(cls, "from_single_file"):
        raise PipelineError(f"diffusers cannot load {cls.__name__} from a single file; use a diffusers folder")
    kwargs: dict[str, Any] = _dtype_kwarg(dtype)
    if _hub_offline():
        kwargs["local_files_only"] = True
    if options.get("config"):
        kwargs["config"] = options["config"]
    if cls.__name__.startswith("StableDiffusion"):
        kwargs["safety_checker"] = None
    try:
        pipe = cls.from_single_file(str(path), **kwargs)  # type: ignore[attr-defined]
    except Exception as exc:  # conversion, config download and key mismatches raise many types
        from huggingface_hub import constants

        raise PipelineError(
            f"cannot load {cls.__name__} from single file {str(path)!r}: {type(exc).__name__}: {exc}. "
            f"diffusers needs the model's configs: from the HF cache ({constants.HF_HUB_CACHE}) or the network, "
            "or a local diffusers folder given as option config=<folder>"
        ) from exc
    return _wrap(pipe, name=name, device=device, dtype=dtype, opts=options)
