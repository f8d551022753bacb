"""``SyntheticPipeline``: a model with no model, for benchmarks and output-path tests.

The output path (device conversion, D2H copy, arena, encoders) is what diffusiond is about, and
measuring it needs a compute phase of known, adjustable length that really occupies the device,
without downloading weights or depending on diffusers. This pipeline calibrates a matmul workload
at load so a batch costs about ``compute_ms`` of device time, spread over the steps, and returns
seed-determined float images or videos generated on the device. On CUDA nothing in ``run``
synchronizes, so the compute thread returns while kernels are still queued, as with a real model.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence

import msgspec
import torch
import torch.nn.functional as F

from diffusiond.ipc.messages import BatchParams, Capabilities, RequestSpec
from diffusiond.pipelines.base import Interrupted, PipelineError, PreviewSink, StepCallback, Task

DEFAULT_COMPUTE_MS = 20.0
# Outputs are bilinear upsamplings of a coarse random grid: image-like smoothness gives encoders a
# realistic job (pure noise is the worst case for PNG) while staying cheap to make on the device.
_COARSE = 8
_CALIBRATE_S = 0.01
_CALIBRATE_ROUNDS = 5
_MIN_MATMUL_MS = 0.1
_MAX_SIDE = 8192


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class SyntheticPipeline:
    """Matmul-backed stand-in for a diffusion model; deterministic outputs per request seed."""

    def __init__(
        self,
        *,
        name: str = "synthetic",
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        options: Mapping[str, str] | None = None,
    ) -> None:
        opts = dict(options or {})
        self.name = name
        self.device = torch.device(device)
        self.dtype = dtype
        task = opts.get("task", "image")
        if task in ("image", Task.TEXT_TO_IMAGE.value):
            self.task = Task.TEXT_TO_IMAGE
        elif task in ("video", Task.TEXT_TO_VIDEO.value):
            self.task = Task.TEXT_TO_VIDEO
        else:
            raise PipelineError(f"synthetic: unknown task {task!r}; use image or video")
        self.compute_ms = self._number(opts, "compute_ms", DEFAULT_COMPUTE_MS)
        # It takes no scheduler names (flow_scheduler None). Its outputs are noise by design, but it
        # has no weights: synthetic_weights labels random-weight models that pass for real ones.
        image = Capabilities(task=self.task.value, width=512, height=512, steps=4, guidance=1.0)
        video = self.task is Task.TEXT_TO_VIDEO
        self.capabilities = msgspec.structs.replace(image, num_frames=16, fps=16) if video else image
        side = int(self._number(opts, "matrix", 2048 if self.device.type == "cuda" else 256))
        if side < 1:
            raise PipelineError(f"synthetic: matrix must be positive, got {side}")
        self._allocate(side)
        self.ms_per_matmul = 0.0
        if self.compute_ms > 0:
            self.ms_per_matmul = self._calibrate()
            # Launch-bound matmuls would make the host, not the device, the bottleneck: grow them
            # (unless the size was given) until one costs enough device time to hide its launch.
            while "matrix" not in opts and self.ms_per_matmul < _MIN_MATMUL_MS and side < _MAX_SIDE:
                side *= 2
                self._allocate(side)
                self.ms_per_matmul = self._calibrate()
        self._asleep = False

    def _allocate(self, side: int) -> None:
        gen = torch.Generator("cpu").manual_seed(0)
        scale = 1.0 / math.sqrt(side)  # keeps products O(1): no inf/denormal slow paths
        self._a = (torch.randn(side, side, generator=gen) * scale).to(self.device, self.dtype)
        self._b = (torch.randn(side, side, generator=gen) * scale).to(self.device, self.dtype)
        self._out = torch.empty_like(self._a)

    @staticmethod
    def _number(opts: Mapping[str, str], key: str, default: float) -> float:
        raw = opts.get(key)
        if raw is None:
            return default
        try:
            value = float(raw)
        except ValueError:
            raise PipelineError(f"synthetic: option {key}={raw!r} is not a number") from None
        if not math.isfinite(value) or value < 0:
            raise PipelineError(f"synthetic: option {key}={raw!r} must be a non-negative number")
        return value

    def _matmul(self) -> None:
        torch.matmul(self._a, self._b, out=self._out)

    def _calibrate(self) -> float:
        """Milliseconds per matmul, measured here: the only place this pipeline synchronizes.

        The fastest of several windows: a busy neighbour (or, on CPU, an OpenMP thread that lost
        its core) stretches some windows by tens of milliseconds, and a single stretched window
        would make every batch run a fraction of ``compute_ms``.
        """
        for _ in range(3):
            self._matmul()
        _sync(self.device)
        count, best = 1, math.inf
        for _ in range(_CALIBRATE_ROUNDS):
            while True:
                start = time.perf_counter()
                for _ in range(count):
                    self._matmul()
                _sync(self.device)
                elapsed = time.perf_counter() - start
                if elapsed >= _CALIBRATE_S or count >= 1 << 16:
                    break
                count *= 2
            best = min(best, elapsed * 1000.0 / count)
        return max(best, 1e-6)

    def matmuls_per_batch(self) -> int:
        """How many matmuls a batch runs: compute_ms worth at the calibrated rate."""
        if self.compute_ms <= 0:
            return 0
        return max(1, round(self.compute_ms / self.ms_per_matmul))

    def run(self, params: BatchParams, requests: Sequence[RequestSpec], on_step: StepCallback,
            on_preview: PreviewSink | None = None) -> list[torch.Tensor]:
        """Spend the calibrated work over the steps, then make each request's output from its seed."""
        if self._asleep:
            raise PipelineError(f"model {self.name} is asleep; wake it before running")
        if params.steps < 1 or params.width < 1 or params.height < 1:
            raise PipelineError(f"synthetic: steps, width and height must be positive, got {params}")
        if params.num_frames is not None and params.num_frames < 1:
            raise PipelineError(f"synthetic: num_frames must be positive, got {params.num_frames}")
        total = self.matmuls_per_batch()
        steps = params.steps
        for step in range(steps):
            for _ in range(total * (step + 1) // steps - total * step // steps):
                self._matmul()
            if not on_step(step + 1, steps):
                raise Interrupted(step + 1, steps)
        return [self._output(params, r.seed) for r in requests]

    def _output(self, params: BatchParams, seed: int) -> torch.Tensor:
        """Float32 in [0, 1] from the seed alone, so batch composition cannot change it."""
        frames = params.num_frames or 1
        gen = torch.Generator(self.device).manual_seed(seed)
        coarse = torch.rand(
            (1, frames * 3, max(1, math.ceil(params.height / _COARSE)), max(1, math.ceil(params.width / _COARSE))),
            generator=gen,
            device=self.device,
            dtype=torch.float32,
        )
        full = F.interpolate(coarse, size=(params.height, params.width), mode="bilinear", align_corners=False)
        if params.num_frames is None:
            return full.view(3, params.height, params.width)
        return full.view(frames, 3, params.height, params.width)

    def sleep(self) -> None:
        """Move the workload's matrices off the device, as a real model's weights would."""
        if self._asleep:
            return
        self._asleep = True
        self._a, self._b, self._out = (t.to("cpu") for t in (self._a, self._b, self._out))
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake(self) -> None:
        if not self._asleep:
            return
        self._a, self._b, self._out = (t.to(self.device) for t in (self._a, self._b, self._out))
        self._asleep = False
