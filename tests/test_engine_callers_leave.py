"""Jobs and moves whose caller leaves half-way, and outputs delivered as their worker dies, against the engine with
fake workers: each ended with a job failed that had succeeded, a job no one would read left running,
a model's queue blocked until a deadline, the daemon paused for good, or a model booked as leaving forever.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sqlite3
from pathlib import Path

import msgspec
import numpy as np
import pytest
from enginekit import CAPS, FakeWorker, Harness, gate_writes, until

from diffusiond.daemon.config import ModelConfig
from diffusiond.daemon.core.inputs import EditInput
from diffusiond.daemon.core.jobs import JobRequest
from diffusiond.daemon.state.store import SqliteStore
from diffusiond.ipc.inputs import InputBuffer
from diffusiond.ipc.messages import Ready
from diffusiond.protocol import ErrorCode, JobStatus, Task, WorkerState

REQ = JobRequest(model="m", prompt="x", n=1, width=64, height=64, steps=2, guidance=1.0, output_format="png", seed=1)


async def test_an_output_delivered_as_its_worker_dies_is_not_failed(tmp_path: Path) -> None:
    """A's output landed and its file was being written (its slot already given back) when the worker died before
    B's output, in the same batch: A failed with ``worker_lost``."""
    h = Harness(store=SqliteStore(tmp_path), max_batch=2, batch_wait_ms=50)
    await h.engine.start()
    gate, writing = gate_writes(h, 5)
    try:
        a, b = h.submit(), h.submit(seed=2)
        await until(lambda: bool(h.worker.executed))
        batch = h.worker.executed[0]
        assert len(batch.requests) == 2
        h.worker.compute_done(batch)
        h.worker.output(batch, 0)
        await until(writing.is_set)
        h.worker.die()  # B's output never comes
        gate.set()
        await h.settle(a)
        await h.settle(b)
        assert a.status == JobStatus.SUCCEEDED, a.error
        assert b.status == JobStatus.FAILED and b.error is not None and b.error["code"] == ErrorCode.WORKER_LOST
    finally:
        gate.set()
        await h.close()


@pytest.mark.parametrize("sync", [True, False])
async def test_a_job_whose_client_leaves_before_it_is_recorded(tmp_path: Path, sync: bool) -> None:
    """A synchronous job has no reader once its client has gone: it is cancelled. A job of ``/v1/jobs`` stays (the
    client may have timed out, and listing finds it). Either way its record lands as the job stands."""
    h = Harness(store=SqliteStore(tmp_path), max_batch=1)
    await h.engine.start()
    held = asyncio.Event()
    add = h.engine.store.add

    async def slow_add(job: object) -> None:
        await held.wait()
        await add(job)  # type: ignore[arg-type]

    h.engine.store.add = slow_add  # type: ignore[method-assign]
    try:
        handler = asyncio.ensure_future(h.engine.accept(REQ, sync=sync))
        await h.settle()
        handler.cancel()  # aiohttp cancels the handler of a client that hung up
        await asyncio.gather(handler, return_exceptions=True)
        (job,) = h.engine.jobs.values()
        held.set()
        if sync:
            assert job.status == JobStatus.CANCELLED and job.error is not None
            assert "the client left before it was accepted" in job.error["message"]
        else:
            assert not job.terminal
        await until(lambda: bool(sqlite3.connect(tmp_path / "jobs.db").execute(
            "SELECT 1 FROM jobs WHERE id = ?", (job.id,)).fetchall()))
    finally:
        held.set()
        await h.close()


async def test_a_batch_that_cannot_be_sent_fails_its_jobs_and_the_queue_goes_on() -> None:
    """An edit whose input was closed (its handler gave up on it) headed the queue pass after pass: each send failed,
    the batch went back to the head, and the model ran nothing else until the edit's deadline."""
    h = Harness(max_batch=1)
    await h.engine.start()
    try:
        busy = [h.engine.submit(dataclasses.replace(REQ, seed=s)) for s in (1, 2)]  # the worker holds two batches
        await h.settle()
        w = h.worker
        assert len(w.executed) == 2
        edit = EditInput(Task.IMAGE_TO_IMAGE, 0.5, InputBuffer(np.zeros((64, 64, 3), np.uint8)), 64, 64)
        stuck = h.engine.submit(dataclasses.replace(REQ, edit=edit, prompt="edit"))
        edit.close()
        later = h.engine.submit(dataclasses.replace(REQ, prompt="later"))
        for batch, job in zip(w.executed[:2], busy, strict=True):
            w.finish(batch)
            await h.settle(job)
        await h.settle(stuck)
        assert stuck.status == JobStatus.FAILED and stuck.error is not None
        assert "could not be sent to the worker: input buffer is closed" in stuck.error["message"]
        await until(lambda: len(w.executed) == 3)
        w.finish(w.executed[2])
        await h.settle(later)
        assert later.status == JobStatus.SUCCEEDED
    finally:
        await h.close()


async def test_a_sleep_whose_caller_leaves_during_its_drain_still_sleeps_and_a_wake_resumes() -> None:
    """Cut short in its drain, the sleep left the daemon paused at level 0: nothing ran again until a wake."""
    h = Harness(max_batch=1)
    await h.engine.start()
    try:
        running = h.submit()
        await h.settle()
        w = h.worker
        sleeping = asyncio.ensure_future(h.engine.sleep(1))  # drains: waits for the running batch
        await asyncio.sleep(0.05)
        sleeping.cancel()  # Ctrl-C on `diffusiond sleep`
        await asyncio.gather(sleeping, return_exceptions=True)
        w.finish(w.executed[0])
        await h.settle(running)
        await until(lambda: h.engine.pool.sleep_level == 1)
        later = h.submit(seed=9)
        await h.settle()
        assert len(w.executed) == 1 and not later.terminal, "asleep: the job waits for the wake"
        await h.engine.wake()
        await until(lambda: any(len(x.executed) for x in h.spawned if x.state == WorkerState.READY and x is not w)
                    or len(w.executed) == 2)
        runner = next(x for x in reversed(h.spawned) if x.executed and x.state != WorkerState.DEAD)
        runner.finish(runner.executed[-1])
        await h.settle(later)
        assert later.status == JobStatus.SUCCEEDED
    finally:
        await h.close()


async def test_an_unload_whose_caller_leaves_is_carried_to_its_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cancelled while the workers stopped, the move was neither ended nor failed: the model stayed booked as leaving,
    and every job for it waited until its deadline."""
    async def start(self: FakeWorker, timeout: float) -> Ready:
        self.state = WorkerState.READY
        return Ready(self.config.model_name, self.config.device, 1.0, msgspec.structs.replace(CAPS, weight_bytes=1))

    stopping = asyncio.Event()
    stop = FakeWorker.stop

    async def slow_stop(self: FakeWorker, timeout: float) -> None:
        await stopping.wait()  # a real worker takes a while to drain and exit
        await stop(self, timeout)

    monkeypatch.setattr(FakeWorker, "start", start)
    monkeypatch.setattr(FakeWorker, "stop", slow_stop)
    h = Harness(models=(ModelConfig(name="a", spec="fake", devices=("cuda:0",)),), device_memory="8GiB",
                host_memory="0", max_batch=1)
    await h.engine.start()
    try:
        unloading = asyncio.ensure_future(h.engine.unload_model("a"))
        await until(lambda: "a" in h.engine.keeper.moving)
        unloading.cancel()  # the client hung up mid-unload
        await asyncio.gather(unloading, return_exceptions=True)
        stopping.set()
        await until(lambda: h.engine.keeper.snapshot()["a"].residency == "disk" and not h.engine.keeper.moving)
        job = h.engine.submit(dataclasses.replace(REQ, model="a"))
        await until(lambda: bool(h.spawned[-1].executed))
        h.spawned[-1].finish(h.spawned[-1].executed[0])
        await h.settle(job)
        assert job.status == JobStatus.SUCCEEDED, job.error
    finally:
        stopping.set()
        await h.close()


async def test_a_job_asked_for_while_the_start_recovers_is_the_one_that_runs(tmp_path: Path) -> None:
    """The socket answers before the start's recovery ends. A request for an unfinished job then read
    it from disk, a copy nothing would ever change: a client following its events after a restart (`diffusiond
    generate`) waited past the job's end. Such a request now waits for the recovery and gets the job in memory."""
    first = Harness(store=SqliteStore(tmp_path), max_batch=1)
    await first.engine.start()
    job_id = (await first.engine.accept(REQ)).id
    await first.close()  # a clean stop leaves the unfinished job in the state dir
    second = Harness(store=SqliteStore(tmp_path), max_batch=1)
    gate = asyncio.Event()
    sweep = second.engine.store.sweep_outputs

    async def slow_sweep() -> object:  # the store is open, its unfinished jobs read, not yet in memory
        await gate.wait()
        return await sweep()

    second.engine.store.sweep_outputs = slow_sweep  # type: ignore[method-assign]
    starting = asyncio.ensure_future(second.engine.start())
    try:
        await asyncio.sleep(0.05)
        asked = asyncio.ensure_future(second.engine.history.find(job_id))
        await asyncio.sleep(0.05)
        assert not asked.done(), "an unfinished job was read from disk while the recovery had not taken it"
        gate.set()
        await starting
        assert await asked is second.engine.jobs[job_id]
    finally:
        gate.set()
        await asyncio.gather(starting, return_exceptions=True)
        await second.close()
