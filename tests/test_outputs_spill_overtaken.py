"""A spill (an unfetched output or trajectory copied out of the arena for a worker waiting for room) is
started as a task: whatever runs before its first step may already have given the slot back (a reader
that took the output, the engine stopping, retention). The spill then has nothing to copy and must end
quietly, with every slot back once, instead of failing its task with a traceback in the log."""

from __future__ import annotations

import gc
import logging
from collections.abc import AsyncIterator

import pytest
from enginekit import ARENA, Harness

from diffusiond.daemon.core.jobs import Job
from diffusiond.ipc.messages import OutputReady
from diffusiond.ipc.sidearrays import TrajectoryDesc, TrajectorySpec
from diffusiond.ipc.tensors import TensorDesc
from diffusiond.protocol import JobStatus


@pytest.fixture
async def h() -> AsyncIterator[Harness]:
    harness = Harness(retention_s=600)
    await harness.engine.start()
    yield harness
    await harness.close()


async def npy_jobs(h: Harness, n: int) -> list[Job]:
    jobs = [h.submit(output_format="npy") for _ in range(n)]
    for j, batch in zip(jobs, h.worker.executed, strict=True):
        h.worker.finish(batch)
        await h.settle(j)
    return jobs


def picture(h: Harness, k: int) -> TensorDesc:
    """A 64x64 picture in the fake worker's arena (as ``FakeWorker.output`` puts it), held, not yet sent."""
    nbytes = 64 * 64 * 3
    slot = 2000 + k
    h.worker.held[slot] = nbytes
    return TensorDesc(dtype="uint8", shape=(64, 64, 3), nbytes=nbytes, slot_id=slot, offset=nbytes * k)


async def trajectory_jobs(h: Harness, n: int) -> list[Job]:
    """PNG jobs that keep a trajectory: the picture's slot goes back once encoded, the trajectory's stays."""
    jobs = [h.submit(trajectory=TrajectorySpec()) for _ in range(n)]
    for j, batch in zip(jobs, h.worker.executed, strict=True):
        h.worker.compute_done(batch)
        out = picture(h, batch.batch_id)
        slot = 1000 + batch.batch_id
        region = TensorDesc(dtype="uint8", shape=(4096,), nbytes=4096, slot_id=slot,
                            offset=ARENA // 2 + 4096 * batch.batch_id)
        arrays = {"log_probs": TensorDesc(dtype="float32", shape=(2,), nbytes=8, slot_id=slot, offset=region.offset)}
        h.worker.held[slot] = 4096
        h.worker.send(OutputReady(batch.requests[0].request_id, batch.batch_id, out,
                                  TrajectoryDesc(region=region, arrays=arrays)))
        await h.settle(j)
        assert j.status == JobStatus.SUCCEEDED and j.items[0].trajectory is not None
    return jobs


async def ended_quietly(h: Harness, caplog: pytest.LogCaptureFixture) -> None:
    """Every spill task ran to its end; none failed (a failed task nobody awaits is logged by asyncio once it
    is collected)."""
    await h.engine.outputs.settled()
    gc.collect()
    failed = [r.getMessage() + str(r.exc_info) for r in caplog.records if r.levelno >= logging.ERROR]
    assert not failed, failed


async def test_an_npy_read_that_overtakes_its_spill(h: Harness, caplog: pytest.LogCaptureFixture) -> None:
    jobs = await npy_jobs(h, 2)
    h.worker.slot_wait(h.worker.arena_capacity - h.worker.held_bytes + 1)  # an output is to be spilled
    [chosen] = [j for j in jobs if j.items[0].spilling]
    async with h.engine.open_output(chosen, 0) as r:  # a download queued before the spill's first step
        r.complete = True
    await ended_quietly(h, caplog)
    item = chosen.items[0]  # its slot went back once, with its one delivery; no copy of it is kept
    assert h.worker.returned.count(jobs.index(chosen)) == 1 and item.data is None and not item.spilling


async def test_the_engine_stopping_overtakes_an_npy_spill(h: Harness, caplog: pytest.LogCaptureFixture) -> None:
    await npy_jobs(h, 2)
    h.worker.slot_wait(h.worker.arena_capacity - h.worker.held_bytes + 1)
    h.engine.outputs.close()  # what ``Engine.stop`` does once its workers are stopped
    await ended_quietly(h, caplog)
    assert sorted(h.worker.returned) == [0, 1] and not h.worker.held


async def test_the_engine_stopping_overtakes_a_trajectory_spill(h: Harness,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    jobs = await trajectory_jobs(h, 2)
    h.worker.slot_wait(ARENA)  # every trajectory is to be spilled
    h.engine.outputs.close()
    await ended_quietly(h, caplog)
    assert not h.worker.held and all(i.trajectory is None and i.trajectory_data is None
                                     for j in jobs for i in j.items)


async def test_retention_overtakes_a_trajectory_spill(h: Harness, caplog: pytest.LogCaptureFixture) -> None:
    jobs = await trajectory_jobs(h, 2)
    h.worker.slot_wait(ARENA)
    h.engine.outputs.expire(jobs[0])  # its retention ends before the spill's first step
    await ended_quietly(h, caplog)
    assert jobs[0].items[0].trajectory is None and jobs[0].items[0].trajectory_data is None
    assert jobs[1].items[0].trajectory_data is not None, "the other one was spilled"
    assert not h.worker.held
