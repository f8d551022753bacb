"""A worker that exits because a live update failed half-way in it (``HalfApplied``: its weights are neither
version) does so between two batches: the batches the engine had sent behind the update never started. They go
back to the queue and run on the replacement, which starts from the files and the accepted updates, instead of
failing with ``worker_lost``. A worker lost any other way still fails what it had. The engine with
fake workers (tests/enginekit.py), and the worker's compute thread, which says so in its ``Fatal``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from enginekit import Harness
from workerkit import bare_compute

from diffusiond.ipc.messages import Fatal, UpdateWeights
from diffusiond.pipelines.errors import HalfApplied
from diffusiond.protocol import ErrorCode, JobStatus, WorkerState
from diffusiond.worker.compute import ComputeThread, LiveUpdate


async def _replaced(h: Harness) -> None:
    async def ready() -> None:
        while len(h.spawned) < 2 or h.worker.state != WorkerState.READY or not h.worker.executed:
            await asyncio.sleep(0.01)

    await asyncio.wait_for(ready(), 5)


async def test_batches_behind_a_half_applied_update_run_on_the_replacement() -> None:
    h = Harness(max_batch=1)
    await h.engine.start()
    jobs = [h.submit(), h.submit()]
    first = h.worker
    assert len(first.executed) == 2
    first.fatal_between_batches = True  # what the handle reads off the worker's FATAL
    first.die("exited with code 70 (a live update failed half-way)")
    await _replaced(h)
    for job in jobs:
        assert job.status != JobStatus.FAILED, job.error
    while len(h.worker.executed) < 2:
        await asyncio.sleep(0.01)
    for batch in list(h.worker.executed):
        h.worker.finish(batch)
    for job in jobs:
        await h.settle(job)
        assert job.status == JobStatus.SUCCEEDED
    await h.close()


async def test_a_worker_lost_otherwise_fails_what_it_had() -> None:
    h = Harness(max_batch=1)
    await h.engine.start()
    job = h.submit()
    h.worker.die()
    await h.settle(job)
    assert job.status == JobStatus.FAILED and job.error is not None
    assert job.error["code"] == ErrorCode.WORKER_LOST
    await h.close()


def test_the_compute_thread_says_it_exits_between_batches_when_an_update_half_applied(
        monkeypatch: pytest.MonkeyPatch) -> None:
    posted: list[Any] = []
    exits: list[int] = []
    compute: ComputeThread = bare_compute(posted, exits)  # type: ignore[assignment]

    def half(msg: Any, fds: Any) -> None:
        raise HalfApplied("OSError: [Errno 5] Input/output error")

    monkeypatch.setattr(compute.adapters, "update", half)
    compute.queue.put(LiveUpdate(UpdateWeights("m", "unet", [], 2), []))
    compute.start()
    compute.thread.join(10)
    assert exits == [70]
    [fatal] = [p for p in posted if isinstance(p, Fatal)]
    assert fatal.between_batches and "a live update failed half-way" in fatal.message


async def test_a_worker_that_fails_half_way_through_a_kept_update_at_its_start_is_not_announced_ready(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A replacement whose copy of a kept update failed half-way answers so and exits. The engine
    may handle its loss before the start resumes; announcing it ready then would put the dead worker back among
    those batches go to. Its own replacement takes the model's jobs."""
    import numpy as np
    from enginekit import FakeWorker

    from diffusiond.client.weights import pack
    from diffusiond.ipc.messages import KIND_OF, Ack

    h = Harness(max_batch=1)
    await h.engine.start()
    fds, tensors = pack({"conv_out.weight": np.ones((4, 4), np.float32)})
    models = h.engine.pool.models
    assert await h.engine.live_components.update(UpdateWeights("m", "unet", tensors), fds, models.__getitem__, 5) == 1
    plain = FakeWorker.command

    async def command(self: FakeWorker, msg: Any, timeout: float, fds: Any = ()) -> Ack:
        if isinstance(msg, UpdateWeights) and self is h.spawned[1]:  # its FATAL and its channel's close come first
            self.die("exited with code 70 (a live update failed half-way)")
            return Ack(KIND_OF[type(msg)], False, "the copy failed after it began (OSError)", restarts=True)
        return await plain(self, msg, timeout, fds)

    monkeypatch.setattr(FakeWorker, "command", command)
    h.spawned[0].die()

    async def third() -> None:
        while len(h.spawned) < 3 or h.worker.state != WorkerState.READY or h.worker not in h.engine.flights.in_flight:
            await asyncio.sleep(0.01)

    await asyncio.wait_for(third(), 5)
    half = h.spawned[1]
    assert half.state == WorkerState.DEAD and half not in h.engine.flights.in_flight
    job = h.submit()
    await h.settle()
    assert not half.executed and len(h.worker.executed) == 1
    h.worker.finish(h.worker.executed[0])
    await h.settle(job)
    assert job.status == JobStatus.SUCCEEDED
    await h.close()
