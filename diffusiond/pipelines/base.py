"""The pipeline protocol the worker drives.

A pipeline runs one batch: requests share ``BatchParams`` (size, steps, guidance) and each has its
own prompt, negative prompt and seed. It returns one tensor per request, still on the device,
float in [0, 1]: ``(C, H, W)`` for images, ``(F, C, H, W)`` for video. Conversion to uint8 and
the copy to shared memory are the worker's job, so every pipeline gets the async output path.

Seeds: each request gets its own ``torch.Generator`` seeded with its seed, so a request gives the
same output alone or inside a batch.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import torch

from diffusiond.ipc.messages import BatchParams, Capabilities, RequestSpec

# Called after each denoising step with (steps_done, total). Returning False stops the run at
# that step; ``run`` then raises ``Interrupted``.
StepCallback = Callable[[int, int], bool]


class Task(enum.StrEnum):
    TEXT_TO_IMAGE = "text-to-image"
    TEXT_TO_VIDEO = "text-to-video"


class PipelineError(Exception):
    """A model could not be loaded or a request cannot run; the message says what to do."""


class Interrupted(Exception):
    """The step callback asked to stop (every request of the batch was cancelled)."""

    def __init__(self, step: int, total: int) -> None:
        super().__init__(f"stopped at step {step} of {total}")
        self.step = step
        self.total = total


# Request defaults a pipeline suggests (the engine fills omitted fields with them): width,
# height, steps, guidance and, for video, num_frames and fps.
Defaults = dict[str, float]


def default_settings(pipe: object, *, steps: int = 25, guidance: float = 7.5) -> Defaults:
    """Native resolution of a diffusers pipeline: the denoiser's sample size times the VAE factor."""
    denoiser = getattr(pipe, "unet", None) or getattr(pipe, "transformer", None)
    sample = getattr(getattr(denoiser, "config", None), "sample_size", None)
    factor = getattr(pipe, "vae_scale_factor", None) or getattr(pipe, "vae_scale_factor_spatial", None) or 8
    side = int(sample[0] if isinstance(sample, (list, tuple)) else sample or 64) * int(factor)
    side = max(64, min(side, 2048)) // 8 * 8
    return {"width": side, "height": side, "steps": steps, "guidance": guidance}


@runtime_checkable
class Pipeline(Protocol):
    name: str
    task: Task
    device: torch.device
    dtype: torch.dtype
    defaults: Defaults

    def run(
        self, params: BatchParams, requests: Sequence[RequestSpec], on_step: StepCallback
    ) -> list[torch.Tensor]:
        """Run one batch; one float [0, 1] tensor per request, on ``self.device``."""
        ...

    def sleep(self) -> None:
        """Move weights off the device so its memory can be used by someone else."""
        ...

    def wake(self) -> None:
        """Bring the weights back onto the device."""
        ...


def generators(requests: Sequence[RequestSpec]) -> list[torch.Generator]:
    """One CPU generator per request: same seed, same noise, whatever the batch or device."""
    return [torch.Generator("cpu").manual_seed(r.seed) for r in requests]


def capabilities_of(pipe: object) -> Capabilities:  # TRANSITIONAL: until every pipeline declares its capabilities
    cap = getattr(pipe, "capabilities", None)
    if isinstance(cap, Capabilities):
        return cap
    d = dict(getattr(pipe, "defaults", {}))
    flow = getattr(pipe, "flow_scheduler", None)
    fields = {k: type(getattr(Capabilities(), k))(v) for k, v in d.items() if k in Capabilities.__struct_fields__}
    return Capabilities(task=str(getattr(pipe, "task", "text-to-image")), flow_scheduler=flow,
                        synthetic_weights=bool(getattr(pipe, "synthetic_weights", False)), **fields)
