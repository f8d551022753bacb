"""Adapters over diffusion pipelines, behind the small ``Pipeline`` protocol the worker drives.

``load_pipeline(spec, ...)`` resolves a model spec: ``tiny`` or ``tiny-video`` (embedded, offline),
``random:<preset>`` (real architectures at full size with random weights, for GPU benchmarks),
``synthetic:...`` (no diffusers, for output-path tests and benchmarks), a local diffusers folder,
a hub id, or a single-file checkpoint.
"""

from diffusiond.pipelines.base import Interrupted, Pipeline, PipelineError, StepCallback, Task
from diffusiond.pipelines.registry import load_pipeline

__all__ = ["Interrupted", "Pipeline", "PipelineError", "StepCallback", "Task", "load_pipeline"]
