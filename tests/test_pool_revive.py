"""A load from disk of a model on two devices whose worker fails to start on one.

``WorkerPool.revive`` gave up at the first failed start while the other device's start still ran: that start was
left to finish on its own (stopped under it by the keeper's clean-up, it then failed putting itself back in a list
that was already empty, a ValueError nobody saw), and the error the jobs got was the worker's bare reason, which
a real worker's FATAL gives without saying which device it was on. Fake workers on two fake GPUs; the start on
cuda:0 is held until the test lets it go, the one on cuda:1 fails at once.
"""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from enginekit import CAPS, FakeWorker, Harness, until
from residencykit import G

from diffusiond.daemon.config import ModelConfig
from diffusiond.daemon.core.jobs import JobRequest
from diffusiond.daemon.workers.link import WorkerStartError
from diffusiond.ipc.messages import Ready
from diffusiond.protocol import ErrorCode, JobStatus, WorkerState

TWO = (ModelConfig(name="m", spec="fake", devices=("cuda:0", "cuda:1")),)
WHY = "injected start-up failure (fault fail_start)"  # a real worker's FATAL: no worker, no device


class Starts:
    """Starts on ``failing`` devices fail with ``WHY``; the others wait for ``gate``. A fake stopped while it loads
    fails its start, as a real worker's process that exits does."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.gate.set()
        self.failing: set[str] = set()


@pytest.fixture
def starts(monkeypatch: pytest.MonkeyPatch) -> Starts:
    s = Starts()

    async def start(self: FakeWorker, timeout: float) -> Ready:
        await asyncio.sleep(0)
        if self.config.device in s.failing:
            self.state = WorkerState.DEAD
            raise WorkerStartError(WHY)
        await s.gate.wait()
        if self.asked_to_stop:
            raise WorkerStartError(f"{self.name} was stopped while it loaded")
        self.state = WorkerState.READY
        return Ready(self.config.model_name, self.config.device, 1.0, msgspec.structs.replace(CAPS, weight_bytes=G))

    monkeypatch.setattr(FakeWorker, "start", start)
    return s


def _live(h: Harness) -> list[FakeWorker]:
    return [w for w in h.spawned if w.state != WorkerState.DEAD]


async def test_revive_ends_only_with_every_start_it_began_and_stops_the_one_that_came_up(starts: Starts) -> None:
    h = Harness(models=TWO, device_memory="8GiB", host_memory="0", max_batch=1)
    await h.engine.start()
    try:
        model = h.engine.pool.model("m")
        await h.engine.pool.retire(model)
        starts.gate.clear()
        starts.failing.add("cuda:1")
        revive = asyncio.ensure_future(h.engine.pool.revive(model))
        await until(lambda: any(w.config.device == "cuda:1" and w.state == WorkerState.DEAD for w in h.spawned[2:]))
        assert not revive.done(), "revive returned while its start on cuda:0 was still under way"
        starts.gate.set()
        with pytest.raises(WorkerStartError) as err:
            await revive
        message = str(err.value)
        assert "cuda:1" in message and WHY in message, message
        up = [w for w in h.spawned[2:] if w.config.device == "cuda:0"]
        assert len(up) == 1 and up[0].asked_to_stop, "the worker that came up on cuda:0 was stopped"
        assert model.workers == [] and model.retired and _live(h) == []
    finally:
        await h.close()


async def test_a_job_whose_load_fails_on_one_device_names_the_device_and_leaves_no_worker(starts: Starts) -> None:
    h = Harness(models=TWO, device_memory="8GiB", host_memory="0", max_batch=1)
    await h.engine.start()
    try:
        await h.engine.unload_model("m")
        starts.gate.clear()
        starts.failing.add("cuda:1")
        job = h.engine.submit(JobRequest(model="m", prompt="x", n=1, width=64, height=64, steps=2, guidance=1.0,
                                         output_format="png", seed=1))
        await until(lambda: any(w.config.device == "cuda:1" and w.state == WorkerState.DEAD for w in h.spawned[2:]))
        starts.gate.set()
        await h.settle(job)
        assert job.status == JobStatus.FAILED and job.error is not None
        assert job.error["code"] == ErrorCode.MODEL_LOAD_FAILED
        assert "cuda:1" in job.error["message"] and WHY in job.error["message"], job.error["message"]
        await h.settle()
        assert _live(h) == [], "no worker holds device memory the books do not count"
        status = h.engine.keeper.snapshot()["m"]
        assert status.residency == "disk" and status.per_device == {"cuda:0": 0, "cuda:1": 0}, status
        starts.failing.clear()  # the files fixed: the next job loads it on both devices
        again = h.engine.submit(JobRequest(model="m", prompt="x", n=1, width=64, height=64, steps=2, guidance=1.0,
                                           output_format="png", seed=1))
        await until(lambda: any(w.executed for w in _live(h)))
        for w in _live(h):
            for batch in w.executed:
                w.finish(batch)
        await h.settle(again)
        assert again.status == JobStatus.SUCCEEDED
        assert sorted(w.config.device for w in _live(h)) == ["cuda:0", "cuda:1"]
    finally:
        await h.close()
