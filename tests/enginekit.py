"""The engine without processes: a fake worker with the shape of ``link.WorkerLink``.

A test builds an ``Engine`` whose pool spawns ``FakeWorker``s, then plays the worker's side by
hand: it reads the EXECUTE and CANCEL messages the engine sent, and answers with the frames a
real worker would send (progress, compute done, an output in a fake arena, a failure), in any
order it likes, or makes the worker die. Every transition of a job can then be checked in
milliseconds, the way vLLM's ``InprocClient`` runs its engine core in-process.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import numpy as np
import pytest

from diffusiond.daemon.config import DaemonConfig, ModelConfig
from diffusiond.daemon.core.engine import Engine
from diffusiond.daemon.core.jobs import Job, JobRequest
from diffusiond.daemon.workers.link import Command, FrameCallback, LostCallback, WorkerStartError
from diffusiond.ipc.frames import Frame
from diffusiond.ipc.inputs import read_inputs
from diffusiond.ipc.messages import (
    KIND_OF,
    Ack,
    Capabilities,
    ComputeDone,
    Execute,
    OutputReady,
    Progress,
    Ready,
    Release,
    RequestEnded,
    Sleep,
    SlotWait,
    Wake,
    WorkerConfig,
)
from diffusiond.ipc.tensors import TensorDesc
from diffusiond.protocol import WorkerState

CAPS = Capabilities(width=64, height=64, steps=2, guidance=1.0)
ARENA = 1 << 20


class FakeWorker:
    """Records what the engine asks; the test answers through ``send``/``output``/``die``."""

    pins = 0  # the host copy a SLEEP leaves it keeping from then on (a real worker on a GPU: its weights'; issue 27)

    def __init__(self, config: WorkerConfig, on_frame: FrameCallback, on_lost: LostCallback,
                 *, fail_start: str | None = None) -> None:
        self.id = config.worker_id
        self.config = config
        self.state = WorkerState.STARTING
        self.started_at = time.monotonic()
        self.loras_loaded: list[str] = []
        self.host_kept = 0
        self.asked_to_stop = False
        self.on_frame = on_frame
        self.on_lost = on_lost
        self.fail_start = fail_start
        self.executed: list[Execute] = []
        self.inputs: list[list[tuple[np.ndarray, np.ndarray | None] | None]] = []  # per batch, per request
        self.cancelled: list[str] = []
        self.killed = False  # kill() was called (the engine gave up on a batch no job wanted)
        self.commands: list[Any] = []
        self.returned: list[int] = []  # slot ids given back, in order
        self.held: dict[int, int] = {}
        self.arena = bytearray(ARENA)
        self._next_slot = 0
        self._seq = 0

    # WorkerLink ---------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return f"fake worker {self.id}"

    @property
    def pid(self) -> int | None:
        return None

    @property
    def arena_capacity(self) -> int:
        return ARENA

    @property
    def held_bytes(self) -> int:
        return sum(self.held.values())

    @property
    def arena_held_bytes(self) -> int:
        return self.held_bytes  # every fake output lies in the arena

    async def start(self, timeout: float) -> Ready:
        await asyncio.sleep(0)
        if self.fail_start:
            self.state = WorkerState.DEAD
            raise WorkerStartError(self.fail_start)
        self.state = WorkerState.READY
        return Ready(self.config.model_name, "cpu", 1.0, CAPS)

    async def stop(self, timeout: float) -> None:
        self.asked_to_stop = True
        self.state = WorkerState.DEAD

    async def command(self, msg: Command, timeout: float, fds: Sequence[int] = ()) -> Ack:
        self.commands.append(msg)
        if isinstance(msg, Sleep):
            self.state, self.host_kept = WorkerState.SLEEPING, self.pins
        elif isinstance(msg, Wake):
            self.state = WorkerState.READY
        elif isinstance(msg, Release):
            self.host_kept = 0
        return Ack(KIND_OF[type(msg)], True, host_kept=self.host_kept)

    def execute(self, batch: Execute, fds: Sequence[int] = ()) -> None:
        # what a worker would read of each request's input (edits), before the fds are closed
        self.inputs.append([read_inputs(fds, r.input) if r.input else None for r in batch.requests])
        for fd in fds:  # like the channel: sent, then closed
            os.close(fd)
        self.executed.append(batch)

    def cancel(self, request_ids: list[str]) -> None:
        self.cancelled.extend(request_ids)

    def kill(self) -> None:
        self.killed = True
        self.die()

    def buffer(self, desc: TensorDesc) -> memoryview:
        return memoryview(self.arena).toreadonly()

    def share(self, desc: TensorDesc) -> tuple[int, int] | None:
        return None

    def return_slot(self, desc: TensorDesc) -> None:
        assert desc.slot_id in self.held, f"slot {desc.slot_id} returned twice or never handed out"
        del self.held[desc.slot_id]
        self.returned.append(desc.slot_id)

    def ping(self) -> None:
        pass

    def answering(self, within: float) -> bool:
        return self.state != WorkerState.DEAD

    # the worker's side, played by the test --------------------------------------------------
    def send(self, msg: Any) -> None:
        self._seq += 1
        self.on_frame(self, Frame(KIND_OF[type(msg)], self._seq, msg))

    def progress(self, batch: Execute, step: int) -> None:
        self.send(Progress(batch.batch_id, step, batch.params.steps))

    def compute_done(self, batch: Execute, working_bytes: int | None = None) -> None:
        """COMPUTE_DONE; ``working_bytes``: the peak a real worker measured (worker/memory.py)."""
        self.send(ComputeDone(batch.batch_id, 5.0, working_bytes=working_bytes,
                              working_batch=len(batch.requests) if working_bytes is not None else 0))

    def output(self, batch: Execute, k: int = 0, value: int = 128) -> TensorDesc:
        """Put request ``k``'s image (H, W, 3 uint8 filled with ``value``) in the arena, send OUTPUT_READY."""
        p = batch.params
        nbytes = p.height * p.width * 3
        offset = self._next_slot * nbytes % (ARENA - nbytes)
        self.arena[offset : offset + nbytes] = bytes([value]) * nbytes
        slot = self._next_slot
        self._next_slot += 1
        desc = TensorDesc(dtype="uint8", shape=(p.height, p.width, 3), nbytes=nbytes, slot_id=slot, offset=offset)
        self.held[slot] = nbytes
        self.send(OutputReady(batch.requests[k].request_id, batch.batch_id, desc))
        return desc

    def finish(self, batch: Execute) -> None:
        """The usual run of a batch: compute, then every output."""
        self.compute_done(batch)
        for k in range(len(batch.requests)):
            self.output(batch, k)

    def fail(self, batch: Execute, k: int = 0, message: str = "CUDA out of memory") -> None:
        self.send(RequestEnded(batch.requests[k].request_id, batch.batch_id, "failed", message, "computing"))

    def slot_wait(self, nbytes: int) -> None:
        self.send(SlotWait("r", nbytes, self.held_bytes, ARENA))

    def die(self, how: str = "was killed by signal SIGKILL") -> None:
        self.state = WorkerState.DEAD
        self.on_lost(self, f"{self.name} {how}")


class Harness:
    """An engine with fake workers, and the workers it spawned, in order."""

    def __init__(self, **overrides: Any) -> None:
        models = overrides.pop("models", (ModelConfig(name="m", spec="fake"),))
        fail_starts: list[str | None] = overrides.pop("fail_starts", [])
        store = overrides.pop("store", None)  # a SqliteStore: what the engine keeps in a state dir
        config = DaemonConfig(models=models, restart_backoff_s=(0.0,), encode_threads=1, **overrides)
        self.spawned: list[FakeWorker] = []

        def spawn(wc: WorkerConfig, env: dict[str, str], on_frame: FrameCallback, on_lost: LostCallback) -> FakeWorker:
            fail = fail_starts.pop(0) if fail_starts else None
            w = FakeWorker(wc, on_frame, on_lost, fail_start=fail)
            self.spawned.append(w)
            return w

        self.engine = Engine(config, spawn=spawn, store=store)

    @property
    def worker(self) -> FakeWorker:
        """The live worker of the first model (the newest one spawned for it)."""
        return self.spawned[-1]

    def submit(self, n: int = 1, **fields: Any) -> Job:
        req = JobRequest(model="m", prompt="a lighthouse", n=n, width=64, height=64, steps=2, guidance=1.0,
                         output_format=fields.pop("output_format", "png"), seed=fields.pop("seed", 7))
        return self.engine.submit(dataclasses.replace(req, **fields))

    async def settle(self, job: Job | None = None, timeout: float = 5.0) -> None:
        """Let the loop run queued callbacks and encoder tasks (until ``job`` ends, if given)."""
        if job is not None:
            await asyncio.wait_for(job.finished.wait(), timeout)
        for _ in range(5):
            await asyncio.sleep(0)

    async def close(self) -> None:
        await self.engine.stop()


def image(data: bytes) -> np.ndarray:
    import io

    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(data)))


def hold_starts(monkeypatch: Any, *, models: Sequence[str] | None = None, weight_bytes: int | None = None,
                ) -> asyncio.Event:
    """Fake workers (of ``models``, or every one) finish their start only once the returned event is set, so a
    test sees a start (a preload, a replacement) mid-way without timing; with ``weight_bytes`` their READY
    reports that size, as a real model's does."""
    opened = asyncio.Event()
    plain = FakeWorker.start

    async def start(self: FakeWorker, timeout: float) -> Ready:
        if models is None or self.config.model_name in models:
            await opened.wait()
        if weight_bytes is None:
            return await plain(self, timeout)
        self.state = WorkerState.READY
        return Ready(self.config.model_name, self.config.device, 1.0,
                     msgspec.structs.replace(CAPS, weight_bytes=weight_bytes))

    monkeypatch.setattr(FakeWorker, "start", start)
    return opened


def gate_writes(h: Harness, wait_s: float) -> tuple[threading.Event, threading.Event]:
    """The store's ``write_output`` held at its start: returns ``(gate, writing)``. ``writing`` is set once an
    output's write has begun; the write then waits for ``gate`` (at most ``wait_s``), so a test acts (a stop, a
    worker's death) while an output's file is being written. Set ``gate`` in a ``finally``."""
    gate, writing = threading.Event(), threading.Event()
    write = h.engine.store.write_output

    def slow_write(*args: Any, **kw: Any) -> Any:
        writing.set()
        gate.wait(wait_s)
        return write(*args, **kw)

    h.engine.store.write_output = slow_write  # type: ignore[method-assign]
    return gate, writing


def job(h: Harness, model: str) -> Job:
    """A 64x64 job of ``model``, submitted straight to the engine."""
    return h.engine.submit(JobRequest(model=model, prompt="x", n=1, width=64, height=64, steps=2, guidance=1.0,
                                      output_format="png", seed=1))


async def until(check: Callable[[], object], timeout: float = 5.0, what: str = "the condition") -> None:
    """Let the loop run until ``check()`` is truthy; fail the test naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.01)
