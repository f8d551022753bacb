"""A run's trajectory for the client (issue 29): latents before and after every step, kept on the device.

The rollout schedulers (``rollout_schedulers.py``) record each step's log-probability; a trainer
also needs the latents the steps went through, to recompute those log-probabilities under the
policy it is training. They are collected here from the pipeline's step callback into one tensor
allocated on the device at the first step, ``(steps + 1, batch, *latent)``, with ``copy_`` only:
nothing here reads a value back, so the forward never waits on the device for them. The copy
thread later takes each request's slice to the arena (``worker/copier.py``).

Packed latents (FLUX keeps them as ``(batch, patches, channels)`` during the loop) are unpacked at
the end with the pipeline's own ``_unpack_latents``, so FLUX's latents arrive as ``(steps + 1, C, h, w)``
like SD's; other packing pipelines (LTX, whose unpacking needs frame and patch sizes) keep the packed shape.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from diffusiond.ipc.messages import BatchParams
from diffusiond.ipc.sidearrays import TrajectorySpec


class LatentRecorder:
    """One run's latents; ``step_end`` is called from the pipeline's step callback."""

    def __init__(self, spec: TrajectorySpec, rollout: Any) -> None:
        self.spec = spec
        self.rollout = rollout  # the recording scheduler: its first step saw the initial latents
        self.latents: torch.Tensor | None = None

    def step_end(self, i: int, total: int, latents: torch.Tensor) -> None:
        if not self.spec.latents:
            return
        if self.latents is None:
            first = getattr(self.rollout, "first_sample", None)
            if first is None:
                raise RuntimeError("the scheduler saw no initial latents: the trajectory cannot start")
            self.latents = torch.empty((total + 1, *latents.shape), dtype=getattr(torch, self.spec.dtype),
                                       device=latents.device)
            self.latents[0].copy_(first)
        if i + 1 < self.latents.shape[0]:
            self.latents[i + 1].copy_(latents)

    def arrays(self, pipe: Any, params: BatchParams, n: int) -> list[dict[str, torch.Tensor]]:
        """Each request's arrays (views into the batch's tensors; the copy thread copies views only)."""
        traj = self.rollout.trajectory()
        if traj is None:
            raise RuntimeError("the run recorded no stochastic step, so it has no trajectory")
        steps = len(traj.timesteps)
        small = {"timesteps": torch.tensor(traj.timesteps, dtype=torch.float32),
                 "sigmas": torch.tensor(traj.sigmas[:steps], dtype=torch.float32)}
        latents = self._unpacked(pipe, params)
        result = []
        for k in range(n):
            arrays: dict[str, torch.Tensor] = {}
            if latents is not None:
                arrays["latents"] = latents[:, k]
            if self.spec.log_probs:
                arrays["log_probs"] = traj.log_probs[k].float()
            result.append({**arrays, **small})
        return result

    def _unpacked(self, pipe: Any, params: BatchParams) -> torch.Tensor | None:
        lat = self.latents
        unpack = getattr(pipe, "_unpack_latents", None)
        if lat is None or lat.dim() != 4 or unpack is None:
            return lat
        # FLUX's (latents, height, width, vae_scale_factor) only: LTX's and others' take other arguments
        if list(inspect.signature(unpack).parameters) != ["latents", "height", "width", "vae_scale_factor"]:
            return lat
        steps, batch = lat.shape[:2]
        flat = pipe._unpack_latents(lat.flatten(0, 1), params.height, params.width, pipe.vae_scale_factor)
        return flat.unflatten(0, (steps, batch))
