"""A worker that dies during a move, with the engine and fake workers on two fake GPUs: the
books end where the workers are, and the jobs that waited end with the reason or run after.

- a load from disk of a model on two devices, one of whose workers dies as it starts: its jobs failed, and the books
  said "disk", but the worker that came up on the other device stayed, holding that device's memory uncounted;
- a move into host memory whose worker on one device dies while the other's sleeps: the books said "device" on both,
  and the sleeping worker was never woken again (its copy in host memory uncounted, jobs sent to the other only).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import msgspec
import pytest
from enginekit import CAPS, FakeWorker, Harness, until
from residencykit import G

from diffusiond.daemon.config import ModelConfig
from diffusiond.daemon.core.jobs import Job, JobRequest
from diffusiond.daemon.workers.link import Command, WorkerStartError
from diffusiond.ipc.errors import ChannelClosed
from diffusiond.ipc.messages import Ack, Ready, Sleep
from diffusiond.protocol import ErrorCode, JobStatus, WorkerState

TWO = (ModelConfig(name="m", spec="fake", devices=("cuda:0", "cuda:1")),)


@pytest.fixture
def gib_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fake workers that weigh 1 GiB, and whose start fails where the Harness's ``fail_starts`` says."""
    async def start(self: FakeWorker, timeout: float) -> Ready:
        await asyncio.sleep(0)
        if self.fail_start:
            self.state = WorkerState.DEAD
            raise WorkerStartError(self.fail_start)
        self.state = WorkerState.READY
        return Ready(self.config.model_name, self.config.device, 1.0,
                     msgspec.structs.replace(CAPS, weight_bytes=G))

    monkeypatch.setattr(FakeWorker, "start", start)


def _live(h: Harness) -> list[FakeWorker]:
    return [w for w in h.spawned if w.state != WorkerState.DEAD]


def _job(h: Harness) -> Job:
    return h.engine.submit(JobRequest(model="m", prompt="x", n=2, width=64, height=64, steps=2, guidance=1.0,
                                      output_format="png", seed=1))


async def _runs_on_both(h: Harness) -> None:
    """A job of two outputs loads the model on both devices and runs there."""
    again = _job(h)
    await until(lambda: len([w for w in _live(h) if w.executed]) == 2)
    for w in _live(h):
        w.finish(w.executed[-1])
    await h.settle(again)
    assert again.status == JobStatus.SUCCEEDED
    assert sorted(w.config.device for w in _live(h)) == ["cuda:0", "cuda:1"]
    assert h.engine.keeper.snapshot()["m"].per_device == {"cuda:0": G, "cuda:1": G}


async def test_a_load_whose_worker_dies_on_one_device_leaves_no_worker_on_the_other(gib_workers: None) -> None:
    died = "fake worker 3 exited with signal SIGKILL while it loaded"
    h = Harness(models=TWO, device_memory="8GiB", host_memory="0", max_batch=1, fail_starts=[None, None, None, died])
    await h.engine.start()
    try:
        await h.engine.unload_model("m")
        assert h.engine.keeper.snapshot()["m"].residency == "disk" and not _live(h)
        failed = _job(h)
        await h.settle(failed)
        assert failed.status == JobStatus.FAILED and failed.error is not None
        assert failed.error["code"] == ErrorCode.MODEL_LOAD_FAILED and died in failed.error["message"]
        await h.settle()
        status = h.engine.keeper.snapshot()["m"]
        assert status.residency == "disk" and status.per_device == {"cuda:0": 0, "cuda:1": 0}
        assert _live(h) == [], "no worker holds device memory the books do not count"
        await _runs_on_both(h)
    finally:
        await h.close()


async def test_a_move_into_host_memory_whose_worker_dies_on_one_device_ends_on_disk(
        gib_workers: None, monkeypatch: pytest.MonkeyPatch) -> None:
    command = FakeWorker.command

    async def dies_on_sleep(self: FakeWorker, msg: Command, timeout: float, fds: Sequence[int] = ()) -> Ack:
        if isinstance(msg, Sleep) and self.config.device == "cuda:1" and self.id == 1:
            self.die()
            raise ChannelClosed(f"{self.name} was killed by signal SIGKILL")
        return await command(self, msg, timeout, fds)

    monkeypatch.setattr(FakeWorker, "command", dies_on_sleep)
    h = Harness(models=TWO, device_memory="8GiB", host_memory="8GiB", max_batch=1)
    await h.engine.start()
    try:
        await h.engine.unload_model("m")
        await h.settle()
        status = h.engine.keeper.snapshot()["m"]
        assert not [w for w in h.spawned if w.state == WorkerState.SLEEPING], "no worker left asleep, unwoken"
        assert status.residency == "disk" and status.per_device == {"cuda:0": 0, "cuda:1": 0}, status
        assert status.host_bytes == 0 and h.engine.keeper.policy.host_used() == 0
        await _runs_on_both(h)
    finally:
        await h.close()
