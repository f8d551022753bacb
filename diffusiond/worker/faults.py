"""Test-only fault injection, installed only when ``WorkerConfig.fault`` names one.

In a normal run none of this is imported: the worker builds a plain ``Copier`` and keeps the
channel's own encoder, so neither the copy thread nor the channel checks for faults. With a
fault, ``process`` builds a ``FaultyCopier`` instead and, for a frame fault, gives the channel a
``TamperingEncoder``. The tests that use them: ``test_worker.py``, ``test_faults.py``,
``test_hardening.py`` (``serve --test-fault``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from diffusiond.ipc.arena import Arena
from diffusiond.ipc.frames import KIND_OFFSET, FrameEncoder
from diffusiond.ipc.messages import Kind
from diffusiond.ipc.tensors import TensorDesc
from diffusiond.worker.copier import Copier, CopyJob, Post
from diffusiond.worker.state import SharedState

FRAME_FAULTS = ("drop_frame", "dup_frame", "corrupt_frame")


@dataclass
class Faults:
    """Parsed from ``WorkerConfig.fault``, a comma-separated list.

    ``copy_gate``: the copy thread finishes batch k only after compute of a later batch started
    (proves compute does not wait for copies; bounded, so a wrong implementation fails, not hangs).
    ``copy_delay_ms=N``: hold each copy N ms (makes an in-flight copy observable for drain tests).
    ``fail_copy``: every copy raises. ``exit_in_copy``: the process dies mid-copy.
    ``finite_error``: the first batch's check for NaN outputs raises (the copy thread must live on).
    ``fail_start``: start-up fails after the model loaded (the worker must report it as FATAL).
    ``load_delay_ms=N``: loading the model takes N ms longer (a daemon that is slow to get ready).
    ``oom=N``: the first N forwards run out of memory (``torch.OutOfMemoryError`` on a GPU,
    ``MemoryError`` on a CPU) before they start: the out-of-memory retry, without a huge allocation.
    ``upscale_oom=SIDE``: an upscaler runs out of memory on any input with a side over SIDE (a tile,
    or a whole picture): its retry in smaller tiles, and the job's ``out_of_memory`` when those fail too.
    ``working_bytes=N``: every batch reports N bytes of working memory, as a GPU's allocator would measure a large
    size, so residency's plans after a measurement run on CPU (a job's size that no longer fits; issue 27).
    ``memory_fraction=F``: the worker's CUDA allocator may take only F of the device
    (``torch.cuda.set_per_process_memory_fraction``), so a large size really runs out of memory.
    ``no_param_table``: the worker sends no PARAM_TABLE, so updates for its model on disk are checked as for
    a model that never ran (against its files), and what they cannot judge is found at its next start.
    ``drop_frame=KIND`` / ``dup_frame=KIND`` / ``corrupt_frame=KIND``: tamper with the first
    outgoing frame of that kind on the wire.
    """

    copy_gate: bool = False
    copy_delay_ms: int = 0
    fail_copy: bool = False
    finite_error: bool = False
    exit_in_copy: bool = False
    fail_start: bool = False
    load_delay_ms: int = 0
    oom: int = 0
    upscale_oom: int = 0
    memory_fraction: float = 0.0
    no_working_measure: bool = False
    no_param_table: bool = False
    working_bytes: int = 0
    frame: tuple[str, Kind] | None = None

    @classmethod
    def parse(cls, spec: str) -> Faults:
        f = cls()
        for part in filter(None, (p.strip() for p in spec.split(","))):
            key, _, value = part.partition("=")
            if key == "copy_gate":
                f.copy_gate = True
            elif key == "copy_delay_ms":
                f.copy_delay_ms = int(value)
            elif key == "fail_copy":
                f.fail_copy = True
            elif key == "finite_error":
                f.finite_error = True
            elif key == "exit_in_copy":
                f.exit_in_copy = True
            elif key == "fail_start":
                f.fail_start = True
            elif key == "load_delay_ms":
                f.load_delay_ms = int(value)
            elif key == "oom":
                f.oom = int(value)
            elif key == "upscale_oom":
                f.upscale_oom = int(value)
            elif key == "no_working_measure":  # residency plans with its estimate, as before any run
                f.no_working_measure = True
            elif key == "no_param_table":  # updates for the model on disk are checked as if it never ran
                f.no_param_table = True
            elif key == "working_bytes":
                f.working_bytes = int(value)
            elif key == "memory_fraction":
                f.memory_fraction = float(value)
            elif key in FRAME_FAULTS:
                try:
                    f.frame = (key, Kind[value.upper()])
                except KeyError:
                    raise ValueError(f"fault {key}: unknown frame kind {value!r}") from None
            else:
                raise ValueError(f"unknown fault {key!r}")
        return f


def forward_fault(faults: Faults | None, cuda: bool) -> Callable[[], None] | None:
    """The compute thread's hook before each forward (``oom=N``), or None when no forward fault is set."""
    if faults is None or not faults.oom:
        return None
    left = [faults.oom]

    def before_forward() -> None:
        if left[0] > 0:
            left[0] -= 1
            error = torch.OutOfMemoryError if cuda else MemoryError
            raise error(f"injected out of memory (fault oom={faults.oom}, {left[0]} more to come)")

    return before_forward


class OomAbove:
    """An upscaler that runs out of memory on inputs with a side over ``side`` (``upscale_oom=SIDE``),
    as one whose tiles are too large for the device would; ``to`` moves the model as ``place`` does."""

    def __init__(self, model: Any, side: int, cuda: bool) -> None:
        self.model, self.side, self.cuda = model, side, cuda

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if max(x.shape[-2:]) > self.side:
            error = torch.OutOfMemoryError if self.cuda else MemoryError
            raise error(f"injected out of memory (fault upscale_oom={self.side}): an input of "
                        f"{x.shape[-1]}x{x.shape[-2]}")
        out: torch.Tensor = self.model(x)
        return out

    def to(self, device: torch.device) -> OomAbove:
        self.model.to(device)
        return self


def upscale_fault(faults: Faults | None, models: dict[str, Any], cuda: bool) -> None:
    """Each upscaler in ``models`` wrapped in ``OomAbove`` where ``upscale_oom`` is set."""
    if faults is not None and faults.upscale_oom:
        for name, model in models.items():
            models[name] = OomAbove(model, faults.upscale_oom, cuda)


class FaultyCopier(Copier):
    """A ``Copier`` that applies the copy faults before each request's copy."""

    def __init__(
        self, arena: Arena, state: SharedState, post: Post, *, device: torch.device, slot_timeout_s: float,
        faults: Faults,
    ) -> None:
        if faults.fail_start:
            raise RuntimeError("injected start-up failure (fault fail_start)")
        super().__init__(arena, state, post, device=device, slot_timeout_s=slot_timeout_s)
        self.faults = faults
        self._gated: set[int] = set()

    def _finite(self, tensors: Sequence[torch.Tensor]) -> list[bool]:
        if self.faults.finite_error:
            self.faults.finite_error = False  # once
            raise RuntimeError("injected failure of the finite check (fault finite_error)")
        return super()._finite(tensors)

    def _copy(self, job: CopyJob, out: torch.Tensor, request_id: str) -> tuple[TensorDesc, int | None]:
        f = self.faults
        if f.copy_gate and job.batch_id not in self._gated:
            self._gated.add(job.batch_id)  # once per batch, before its first copy
            self._wait_for_later_compute(job.batch_id, timeout=10.0)
        if f.fail_copy:
            raise RuntimeError("injected copy failure (fault fail_copy)")
        if f.exit_in_copy:
            os._exit(3)
        if f.copy_delay_ms:
            time.sleep(f.copy_delay_ms / 1000)
        return super()._copy(job, out, request_id)

    def _wait_for_later_compute(self, batch_id: int, timeout: float) -> bool:
        """Wait until a forward after ``batch_id`` started, or a drain began (then no later batch
        is coming and holding the copy back would only delay the drain)."""
        state = self.state

        def seen() -> bool:
            return any(
                (e.name == "compute_start" and e.batch_id > batch_id) or e.name.startswith("drain_start")
                for e in state.trace
            )

        with state.lock:
            return state.changed.wait_for(seen, timeout)


class TamperingEncoder(FrameEncoder):
    """Encodes like ``FrameEncoder``, then tampers with the first frame of one kind: ``drop_frame``
    returns no bytes (the channel then sends nothing, but the sequence number is spent),
    ``dup_frame`` the frame twice, ``corrupt_frame`` the frame with its last byte flipped."""

    def __init__(self, action: str, kind: Kind, max_body: int) -> None:
        super().__init__(max_body)
        self.action = action
        self.kind = kind
        self.fired = False

    def encode(self, msg: msgspec.Struct, nfds: int = 0) -> bytes:
        data = super().encode(msg, nfds)
        if self.fired or data[KIND_OFFSET] != self.kind:
            return data
        self.fired = True
        if self.action == "drop_frame":
            return b""
        if self.action == "dup_frame":
            return data + data
        corrupted = bytearray(data)
        corrupted[-1] ^= 0xFF
        return bytes(corrupted)


def tamper(encoder: FrameEncoder, action: str, kind: Kind) -> TamperingEncoder:
    """A ``TamperingEncoder`` that continues ``encoder``'s sequence numbers."""
    tampering = TamperingEncoder(action, kind, encoder.max_body)
    tampering.next_seq = encoder.next_seq
    return tampering
