"""The forward-only limit: the pipeline called in a loop in this process, outputs left on the device.

It is the ceiling for a model, size and batch: no output ever leaves the GPU and nothing runs
beside the forwards. The pipeline is loaded once and measured in every round of the run, between
the daemon's runs, so that the daemon is always compared with a limit measured minutes apart,
not at the other end of the run.
"""

from __future__ import annotations

import gc
import time
from dataclasses import asdict
from typing import Any

from diffusiond.bench.report import ModeResult, Setup
from diffusiond.bench.trace import summarize

PROMPT = "a photograph of an astronaut riding a horse on the moon, highly detailed"


class Limit:
    """``limit`` (the eager pipeline) or, with ``compiled``, ``limit-compiled`` (the pipeline as
    ``--compile`` runs it: the ceiling a compiled daemon is measured against)."""

    def __init__(self, s: Setup, compiled: bool = False) -> None:
        import torch

        from diffusiond.ipc.messages import BatchParams
        from diffusiond.pipelines import load_pipeline
        from diffusiond.pipelines.ltx2 import as_served

        self.setup = s
        self.cuda = s.device.startswith("cuda")
        self.mode = "limit-compiled" if compiled else "limit"
        self.pipe = load_pipeline(s.model, device=s.device, dtype=s.dtype)
        if compiled:
            from diffusiond.pipelines.compile import CompiledPipeline
            from diffusiond.pipelines.spec import model_options

            self.pipe = CompiledPipeline(self.pipe, s.compile or "default", model_options(s.model))
        self.params = BatchParams(width=s.width, height=s.height, steps=s.steps, guidance=s.guidance,
                                  num_frames=s.frames, output_dtype=s.output_dtype)
        self.reqs = as_served(self.pipe.capabilities, PROMPT, range(s.batch), "")  # the daemon's default job
        t0 = time.perf_counter()
        with torch.inference_mode():
            for _ in range(3 if compiled else 1):  # first calls: compiled, CUDA graphs recorded, allocator grown
                self._forward()
        self.warmup_s = time.perf_counter() - t0

    def _forward(self) -> Any:
        return self.pipe.run(self.params, self.reqs, lambda step, total: True)

    def measure(self, round_: int = 0) -> ModeResult:
        import torch

        s = self.setup
        batches = max(1, s.requests // s.batch)
        events: list[tuple[str, int, int]] = []
        gpu_marks: list[tuple[str, int, Any]] = []

        def mark(name: str, k: int) -> None:
            if not s.trace:
                return
            events.append((name, k, time.monotonic_ns()))
            if self.cuda:
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                gpu_marks.append((name, k, ev))

        with torch.inference_mode():
            self._forward()  # the daemon ran since the last round: caches and clocks settle again
            if self.cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            outs = None
            for k in range(batches):
                mark("compute_start", k)
                outs = self._forward()
                mark("compute_end", k)
            if self.cuda:
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - t0
        del outs
        trace = None
        if s.trace:
            gpu_events = [(n, k, int(gpu_marks[0][2].elapsed_time(ev) * 1e6)) for n, k, ev in gpu_marks]
            summary = summarize(events, gpu_events)
            trace = asdict(summary) if summary else None
        n = batches * s.batch
        per_batch = elapsed / batches * 1000
        note = "forward only, outputs left on the device"
        if self.mode == "limit-compiled":
            note += f"; compiled ({s.compile or 'default'}), first calls took {self.warmup_s:.0f} s"
        return ModeResult(self.mode, n, elapsed, n / elapsed, None, None, {"compute": per_batch},
                          note=note, trace=trace, round=round_)

    def close(self) -> None:
        import torch

        del self.pipe
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()
