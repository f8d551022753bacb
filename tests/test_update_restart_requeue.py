"""A worker that exits because a live update failed half-way in it (``HalfApplied``: its weights are neither
version) does so between two batches: the batches the engine had sent behind the update never started. They go
back to the queue and run on the replacement, which starts from the files and the accepted updates, instead of
failing with ``worker_lost`` (review48-a 4). A worker lost any other way still fails what it had. The engine with
fake workers (tests/enginekit.py), and the worker's compute thread, which says so in its ``Fatal``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from enginekit import Harness
from workerkit import bare_compute

from diffusiond.ipc.messages import Fatal, UpdateWeights
from diffusiond.protocol import ErrorCode, JobStatus, WorkerState
from diffusiond.worker.compute import ComputeThread, LiveUpdate
from diffusiond.worker.update_copy import HalfApplied


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
