"""State shared by the worker's threads: in-flight requests, cancellations, copies pending, trace.

Everything here is guarded by one lock and touched briefly; no thread holds it while computing
or copying.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from diffusiond.ipc.messages import TraceEvent

if TYPE_CHECKING:
    import torch


@dataclass
class SharedState:
    lock: threading.Lock = field(default_factory=threading.Lock)
    changed: threading.Condition = field(init=False)
    in_flight: set[str] = field(default_factory=set)
    cancelled: set[str] = field(default_factory=set)
    trace: list[TraceEvent] = field(default_factory=list)
    copies_pending: int = 0
    trace_gpu: bool = False
    gpu_events: list[tuple[str, int, torch.cuda.Event]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.changed = threading.Condition(self.lock)

    def record(self, name: str, batch_id: int) -> None:
        with self.lock:
            self.trace.append(TraceEvent(name, batch_id, time.monotonic_ns()))
            if len(self.trace) > 10_000:
                del self.trace[:5_000]
            self.changed.notify_all()

    def record_gpu(self, name: str, batch_id: int, stream: torch.cuda.Stream | None = None) -> None:
        """A timed CUDA event on ``stream`` (default: current): where the GPU, not the CPU, was."""
        if not self.trace_gpu:
            return
        import torch

        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream)
        with self.lock:
            self.gpu_events.append((name, batch_id, ev))
            if len(self.gpu_events) > 20_000:  # bounded, like the host trace: a long run keeps its tail
                del self.gpu_events[:10_000]

    def gpu_trace(self) -> list[TraceEvent]:
        with self.lock:
            events = list(self.gpu_events)
        if not events:
            return []
        base = events[0][2]
        out = []
        for name, batch_id, ev in events:
            ev.synchronize()
            out.append(TraceEvent(name, batch_id, int(base.elapsed_time(ev) * 1e6)))
        return out

    def admit(self, request_ids: list[str]) -> None:
        with self.lock:
            self.in_flight.update(request_ids)

    def cancel(self, request_ids: list[str]) -> None:
        with self.lock:
            self.cancelled.update(r for r in request_ids if r in self.in_flight)

    def is_cancelled(self, request_id: str) -> bool:
        with self.lock:
            return request_id in self.cancelled

    def all_cancelled(self, request_ids: list[str]) -> bool:
        with self.lock:
            return all(r in self.cancelled for r in request_ids)

    def holds(self, request_id: str) -> bool:
        """Whether ``request_id`` was admitted and has had no answer yet."""
        with self.lock:
            return request_id in self.in_flight

    def finish(self, request_id: str) -> None:
        with self.lock:
            self.in_flight.discard(request_id)
            self.cancelled.discard(request_id)

    def copy_queued(self) -> None:
        with self.lock:
            self.copies_pending += 1

    def copy_done(self) -> None:
        with self.lock:
            self.copies_pending -= 1
            self.changed.notify_all()

    def drain(self, timeout: float) -> bool:
        """Wait (bounded) until no copy is queued or running."""
        with self.lock:
            return self.changed.wait_for(lambda: self.copies_pending == 0, timeout)
