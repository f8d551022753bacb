"""``load_pipeline``: turn a model spec from the config or the CLI into a ready ``Pipeline``.

A spec is one string so that a config file, a CLI flag and an HTTP field can all name a model the
same way; ``spec`` reads it and this module hands it to the loader of its kind. Every failure is a
``PipelineError`` whose message says what was tried and what to do, because a daemon that cannot
load its model is only as useful as the line it logs.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from diffusiond.pipelines.base import Pipeline, PipelineError
from diffusiond.pipelines.loaders import load_folder, load_gguf, load_hub
from diffusiond.pipelines.presets import load_preset
from diffusiond.pipelines.single_file import load_single_file
from diffusiond.pipelines.spec import check_options, check_second_expert, parse_spec
from diffusiond.pipelines.synthetic import SyntheticPipeline
from diffusiond.pipelines.tiny import DEFAULTS as TINY_DEFAULTS
from diffusiond.pipelines.tiny import ensure_tiny
from diffusiond.pipelines.tiny_flux import DEFAULTS as TINY_FLUX_DEFAULTS
from diffusiond.pipelines.tiny_flux import ensure_tiny_flux
from diffusiond.pipelines.tiny_inpaint import ensure_tiny_inpaint
from diffusiond.pipelines.tiny_video import DEFAULTS as TINY_VIDEO_DEFAULTS
from diffusiond.pipelines.tiny_video import ensure_tiny_video

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


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
    """Resolve ``spec`` (see ``spec.ACCEPTED_FORMS``) and return a pipeline on ``device``.

    ``options`` (the config's) take precedence over options written in the spec itself.
    """
    torch_dtype = parse_dtype(dtype)
    dev = parse_device(device)
    parsed = parse_spec(spec)
    opts = {**parsed.options, **(options or {})}
    check_options(opts)
    check_second_expert(parsed.kind, opts)
    if parsed.kind == "synthetic":
        return SyntheticPipeline(name=name or "synthetic", device=dev, dtype=torch_dtype, options=opts)
    if parsed.kind == "tiny":
        return load_folder(
            ensure_tiny(), name=name or "tiny", device=dev, dtype=torch_dtype, options=opts,
            defaults=TINY_DEFAULTS,
        )  # fmt: skip
    if parsed.kind == "tiny-inpaint":
        return load_folder(
            ensure_tiny_inpaint(), name=name or "tiny-inpaint", device=dev, dtype=torch_dtype, options=opts,
            defaults=TINY_DEFAULTS,
        )  # fmt: skip
    if parsed.kind == "tiny-video":
        return load_folder(
            ensure_tiny_video(), name=name or "tiny-video", device=dev, dtype=torch_dtype, options=opts,
            defaults=TINY_VIDEO_DEFAULTS,
        )  # fmt: skip
    if parsed.kind == "tiny-flux":
        return load_folder(
            ensure_tiny_flux(), name=name or "tiny-flux", device=dev, dtype=torch_dtype, options=opts,
            defaults=TINY_FLUX_DEFAULTS,
        )  # fmt: skip
    if parsed.kind == "random":
        return load_preset(parsed.target, name=name, device=dev, dtype=torch_dtype, options=opts)
    path = Path(parsed.target)
    if parsed.kind == "folder":
        return load_folder(path, name=name or path.name, device=dev, dtype=torch_dtype, options=opts)
    if parsed.kind == "checkpoint":
        if not path.is_file():
            raise PipelineError(f"checkpoint file {spec.strip()!r} does not exist")
        return load_single_file(path, name=name or path.stem, device=dev, dtype=torch_dtype, options=opts)
    if parsed.kind == "gguf":
        if not path.is_file():
            raise PipelineError(f"GGUF file {parsed.target!r} does not exist")
        return load_gguf(path, name=name or path.stem, device=dev, dtype=torch_dtype, options=opts)
    return load_hub(parsed.target, name=name or parsed.target, device=dev, dtype=torch_dtype, options=opts)
