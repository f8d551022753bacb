"""The pipeline protocol the worker drives.

A pipeline runs one batch: requests share ``BatchParams`` (size, steps, guidance) and each has its
own prompt, negative prompt and seed. It returns one tensor per request, still on the device,
float in [0, 1]: ``(C, H, W)`` for images, ``(F, C, H, W)`` for video. Conversion to uint8 and
the copy to shared memory are the worker's job, so every pipeline gets the async output path.

What a pipeline can do (task, request defaults, frame rule, which schedulers fit, whether its
weights are random) is its ``capabilities``, fixed when it is constructed: the worker sends them
in READY and admission checks requests against them, so nothing may change them after loading.

Seeds: each request gets its own ``torch.Generator`` seeded with its seed, so a request gives the
same output alone or inside a batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, TypedDict, runtime_checkable

import msgspec
import numpy as np
import torch

import diffusiond.pipelines.offload as offload
from diffusiond.ipc.messages import BatchParams, Capabilities, RequestSpec
from diffusiond.pipelines.errors import Interrupted, PipelineError
from diffusiond.protocol import Task

__all__ = [
    "Capabilities",
    "EditArrays",
    "EditingPipeline",
    "Interrupted",
    "Pipeline",
    "PipelineError",
    "PreviewSink",
    "RequestDefaults",
    "StepCallback",
    "Task",
    "generators",
    "native_side",
    "with_defaults",
]

# Called after each denoising step with (steps_done, total). Returning False stops the run at
# that step; ``run`` then raises ``Interrupted``.
StepCallback = Callable[[int, int], bool]

# Called at the steps where requests asked for a preview, with (steps_done, total, pictures):
# pictures pairs a request's index in the batch with its uint8 (H, W, 3) picture, still on the
# device. It must only launch work and enqueue: it runs inside the denoising loop.
PreviewSink = Callable[[int, int, list[tuple[int, torch.Tensor]]], None]


class RequestDefaults(TypedDict, total=False):
    """Request defaults a model knows better than its adapter can infer (the published model's
    native size and steps, a tiny model's CPU-friendly ones); they override the inferred ones."""

    width: int
    height: int
    steps: int
    guidance: float
    num_frames: int
    fps: int


def with_defaults(capabilities: Capabilities, defaults: RequestDefaults | None) -> Capabilities:
    """``capabilities`` with ``defaults`` laid over them."""
    return msgspec.structs.replace(capabilities, **defaults) if defaults else capabilities


def native_side(pipe: Any) -> int:
    """Native resolution of a diffusers pipeline: the denoiser's sample size times the VAE factor,
    so an omitted size gives what the model was trained at."""
    denoiser = getattr(pipe, "unet", None) or getattr(pipe, "transformer", None)
    sample = getattr(getattr(denoiser, "config", None), "sample_size", None)
    factor = getattr(pipe, "vae_scale_factor", None) or getattr(pipe, "vae_scale_factor_spatial", None) or 8
    side = int(sample[0] if isinstance(sample, list | tuple) else sample or 64) * int(factor)
    return max(64, min(side, 2048)) // 8 * 8


@runtime_checkable
class Pipeline(Protocol):
    name: str
    task: Task
    device: torch.device
    dtype: torch.dtype
    capabilities: Capabilities

    def run(self, params: BatchParams, requests: Sequence[RequestSpec], on_step: StepCallback,
            on_preview: PreviewSink | None = None) -> list[torch.Tensor]:
        """Run one batch; one float [0, 1] tensor per request, on ``self.device``. Pipelines whose
        capabilities declare ``previews`` call ``on_preview`` every ``preview_every`` steps of a
        request that asks for it (not at the last step: the output itself comes next)."""
        ...

    def sleep(self) -> None:
        """Move weights off the device so its memory can be used by someone else."""
        ...

    def wake(self) -> None:
        """Bring the weights back onto the device."""
        ...


def weight_bytes(pipeline: Pipeline, extras: Iterable[torch.nn.Module] = ()) -> int:
    """The bytes of a pipeline's modules (parameters and buffers, each tensor once), as residency
    counts a model: read off the loaded modules, so it is what the device really holds. An offloaded
    model counts what its offload keeps on the device (pipelines/offload.py), not what it owns.
    ``extras`` are the modules its worker keeps beside it on the same device (ControlNets, IP-Adapter
    image encoders, upscalers), which come and go with it: a FLUX union ControlNet is 6.6 GB that a
    count of the pipeline alone left out of ``--device-memory``."""
    inner = getattr(pipeline, "inner", pipeline)  # a compiled pipeline wraps the loaded one
    offloaded = getattr(inner, "device_weight_bytes", None)  # an offloaded model keeps only part on the device
    counted = offloaded() if callable(offloaded) else None
    if isinstance(counted, int):
        return counted + _tensor_bytes(extras)
    components = getattr(getattr(inner, "_pipe", None), "components", None) or vars(inner)
    return _tensor_bytes([*(m for m in components.values() if isinstance(m, torch.nn.Module)), *extras])


def host_weight_bytes(pipeline: Pipeline) -> int:
    """What an offloaded model keeps in host memory while on its device (``offload.host_bytes``), which
    residency counts against ``--host-memory`` beside ``weight_bytes``; 0 for a resident one."""
    inner = getattr(pipeline, "inner", pipeline)
    pipe = getattr(inner, "_pipe", None)
    mode = pipeline.capabilities.offload
    return 0 if pipe is None or mode == "none" else offload.host_bytes(pipe, mode)


def _tensor_bytes(modules: Iterable[torch.nn.Module]) -> int:
    """The bytes of ``modules``' parameters and buffers, each tensor once (by its storage's address)."""
    seen: set[int] = set()
    total = 0
    for module in modules:
        for tensor in [*module.parameters(), *module.buffers()]:
            if tensor.data_ptr() in seen:
                continue
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    return total


EditArrays = tuple[np.ndarray, np.ndarray | None]
"""One edit's input: the image, uint8 (H, W, 3), and for inpainting the mask, uint8 (H, W, 1), 255
where to repaint (``ipc.inputs.read_inputs``)."""


@runtime_checkable
class EditingPipeline(Protocol):
    """A pipeline that can also edit images (its ``capabilities.edits`` say which tasks)."""

    name: str

    def edit(self, params: BatchParams, requests: Sequence[RequestSpec], inputs: Sequence[EditArrays],
             on_step: StepCallback, on_preview: PreviewSink | None = None, **more: Any) -> list[torch.Tensor]:
        """Run one batch of ``params.edit``; ``inputs[i]`` belongs to ``requests[i]``; previews as ``run``. A
        model that takes several input pictures an edit (``capabilities.max_input_images`` > 1) also takes
        ``pictures=``: each request's pictures before its image (pipelines/qwen_edit_plus.py)."""
        ...


def generators(requests: Sequence[RequestSpec]) -> list[torch.Generator]:
    """One CPU generator per request: same seed, same noise, whatever the batch or device."""
    return [torch.Generator("cpu").manual_seed(r.seed) for r in requests]
