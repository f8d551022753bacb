"""Adapters over diffusion pipelines, behind the small ``Pipeline`` protocol the worker drives.

``load_pipeline(spec, ...)`` resolves a model spec: ``tiny``, ``tiny-inpaint``, ``tiny-video`` or
``tiny-flux`` (embedded, offline),
``random:<preset>`` (real architectures at full size with random weights, for GPU benchmarks),
``synthetic:...`` (no diffusers, for output-path tests and benchmarks), a local diffusers folder,
a hub id, or a single-file checkpoint.

Importing the package loads no torch: the daemon reads specs (``pipelines.spec``) without it, and
only the worker, which loads a model, pays for torch, through ``load_pipeline`` and ``Pipeline``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from diffusiond.pipelines.errors import Interrupted, PipelineError
from diffusiond.protocol import Task

if TYPE_CHECKING:
    from diffusiond.pipelines.base import Pipeline, StepCallback
    from diffusiond.pipelines.registry import load_pipeline

__all__ = ["Interrupted", "Pipeline", "PipelineError", "StepCallback", "Task", "load_pipeline"]

_LAZY = {
    "Pipeline": "diffusiond.pipelines.base",
    "StepCallback": "diffusiond.pipelines.base",
    "load_pipeline": "diffusiond.pipelines.registry",
}


def __getattr__(name: str) -> Any:
    """The torch-backed names, imported on first use."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
