"""A small engine stand-in for worker tests: the real WorkerHandle, real process, real channel."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field

import numpy as np

from diffusiond.daemon.workers.handle import WorkerHandle
from diffusiond.ipc import messages as m
from diffusiond.ipc.frames import Frame
from diffusiond.ipc.tensors import as_numpy
from diffusiond.protocol import WorkerState


@dataclass
class Result:
    request_id: str
    array: np.ndarray | None = None  # a private copy, taken before the slot is released
    desc: m.TensorDesc | None = None  # type: ignore[name-defined]
    ended: m.RequestEnded | None = None
    progress: list[int] = field(default_factory=list)
    compiling: bool = False  # the worker said it compiles this request's batch shape


class Driver:
    """Collects frames per request; ``run`` sends batches and waits for every request to end."""

    _ids = itertools.count()

    def __init__(self, config: m.WorkerConfig, *, release: bool = True, start_timeout: float = 120) -> None:
        self.release = release
        self.start_timeout = start_timeout
        self.results: dict[str, Result] = {}
        self.batch_of: dict[str, int] = {}
        self.compute_done: list[int] = []
        self.lost: list[str] = []
        self._changed = asyncio.Event()
        self.handle = WorkerHandle(config, on_frame=self._on_frame, on_lost=self._on_lost)

    async def __aenter__(self) -> Driver:
        await self.handle.start(timeout=self.start_timeout)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.handle.state != WorkerState.DEAD:
            await self.handle.stop(timeout=30)

    def _on_lost(self, handle: WorkerHandle, reason: str) -> None:
        self.lost.append(reason)
        self._changed.set()

    def _on_frame(self, handle: WorkerHandle, frame: Frame) -> None:
        msg = frame.msg
        if isinstance(msg, m.OutputReady):
            r = self.results[msg.request_id]
            r.desc = msg.tensor
            r.array = as_numpy(handle.buffer(msg.tensor), msg.tensor).copy()
            if self.release:
                handle.return_slot(msg.tensor)
        elif isinstance(msg, m.RequestEnded):
            self.results[msg.request_id].ended = msg
        elif isinstance(msg, m.ComputeDone):
            self.compute_done.append(msg.batch_id)
        elif isinstance(msg, m.Progress):
            for rid, b in self.batch_of.items():
                if b == msg.batch_id:
                    self.results[rid].progress.append(msg.step)
                    self.results[rid].compiling |= msg.compiling
        self._changed.set()

    def submit(self, params: m.BatchParams, seeds: list[int], prompt: str = "a red fox") -> tuple[int, list[str]]:
        batch_id = next(self._ids)
        reqs = [m.RequestSpec(request_id=f"r{batch_id}-{i}", prompt=prompt, seed=s) for i, s in enumerate(seeds)]
        for r in reqs:
            self.results[r.request_id] = Result(r.request_id)
            self.batch_of[r.request_id] = batch_id
        self.handle.execute(m.Execute(batch_id, params, reqs))
        return batch_id, [r.request_id for r in reqs]

    def done(self, rid: str) -> bool:
        r = self.results[rid]
        return r.array is not None or r.ended is not None

    async def wait(self, rids: list[str], timeout: float = 120) -> list[Result]:
        async def until() -> None:
            while not all(self.done(r) for r in rids):
                if self.lost:
                    raise AssertionError(f"worker lost: {self.lost}")
                self._changed.clear()
                await self._changed.wait()

        await asyncio.wait_for(until(), timeout)
        return [self.results[r] for r in rids]

    async def run(self, params: m.BatchParams, seeds: list[int], prompt: str = "a red fox") -> list[Result]:
        _, rids = self.submit(params, seeds, prompt)
        return await self.wait(rids)

    async def wait_for(self, predicate, timeout: float = 60) -> None:  # type: ignore[no-untyped-def]
        async def until() -> None:
            while not predicate():
                self._changed.clear()
                await self._changed.wait()

        await asyncio.wait_for(until(), timeout)

    async def trace(self) -> m.Ack:
        return await self.handle.command(m.Trace(), timeout=30)


def config(spec: str = "tiny", **kw: object) -> m.WorkerConfig:
    base: dict[str, object] = {"worker_id": 0, "model_name": spec.split(":")[0], "model_spec": spec,
                               "arena_bytes": 16 << 20, "progress_interval_s": 0.0}
    base.update(kw)
    return m.WorkerConfig(**base)  # type: ignore[arg-type]


def events(ack: m.Ack) -> list[tuple[str, int]]:
    return [(e.name, e.batch_id) for e in ack.trace]


def bare_compute(posted: list[object], exits: list[int]) -> object:
    """A worker's compute thread, not started, on a stand-in model (CPU, no weights) and a copier: for what the
    thread does around its batches (binding its device, dying with a reason). What it posts goes to ``posted``,
    its exit codes to ``exits``."""
    from types import SimpleNamespace

    import torch

    from diffusiond.ipc.arena import Arena
    from diffusiond.worker.compute import ComputeThread
    from diffusiond.worker.copier import Copier
    from diffusiond.worker.state import SharedState

    cpu = torch.device("cpu")
    pipe = SimpleNamespace(name="m", device=cpu, capabilities=SimpleNamespace(offload="none", task="text-to-image"))
    copier = Copier(Arena(1 << 20), SharedState(), lambda *a, **k: None, device=cpu, slot_timeout_s=1.0)
    return ComputeThread(pipe, copier, SharedState(), lambda msg, *a, **k: posted.append(msg),  # type: ignore[arg-type]
                         sync_output=True, progress_interval_s=0.0, drain_timeout_s=1.0, on_exit=exits.append)
