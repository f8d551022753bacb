"""A model on two workers whose SLEEP or WAKE one of them refuses, against the engine with fake workers: the move is
all or none (``WorkerPool.sleep_model``, ``wake_model``). Where it is not, every worker of the model stops, the books
say "disk", and the next job loads the model anew on each device; no worker is left half moved (asleep, never woken,
its host copy uncounted), and every job ends.

On two fake GPUs the moves are residency's (an unload by hand to host memory, a job's load from there); on two CPU
workers they are the daemon's sleep and wake, which pause a CPU model in place.
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
from diffusiond.daemon.errors import PowerFailed
from diffusiond.daemon.workers.link import Command
from diffusiond.ipc.messages import KIND_OF, Ack, Ready, Sleep, Wake
from diffusiond.protocol import ErrorCode, JobStatus, WorkerState

GPUS = (ModelConfig(name="m", spec="fake", devices=("cuda:0", "cuda:1")),)
CPUS = (ModelConfig(name="m", spec="fake", devices=("cpu", "cpu")),)
WHY = "RuntimeError: CUDA error: unspecified launch failure"


class Refusals:
    """Which command the worker with id ``worker`` refuses (as a real worker answers a move that raised)."""

    def __init__(self) -> None:
        self.command: type[Sleep] | type[Wake] | None = None
        self.worker = 1
        self.times_out = False  # every worker's answer to ``command`` never comes (the command stays queued there)


@pytest.fixture
def refusals(monkeypatch: pytest.MonkeyPatch) -> Refusals:
    r = Refusals()
    command = FakeWorker.command

    async def start(self: FakeWorker, timeout: float) -> Ready:
        await asyncio.sleep(0)
        self.state = WorkerState.READY
        return Ready(self.config.model_name, self.config.device, 1.0, msgspec.structs.replace(CAPS, weight_bytes=G))

    async def refusing(self: FakeWorker, msg: Command, timeout: float, fds: Sequence[int] = ()) -> Ack:
        if r.command is not None and isinstance(msg, r.command) and r.times_out:
            self.commands.append(msg)
            raise TimeoutError
        if r.command is not None and isinstance(msg, r.command) and self.id == r.worker:
            self.commands.append(msg)
            verb = "sleep" if isinstance(msg, Sleep) else "wake"
            return Ack(KIND_OF[type(msg)], False, f"{verb} failed: {WHY}", host_kept=self.host_kept)
        return await command(self, msg, timeout, fds)

    monkeypatch.setattr(FakeWorker, "start", start)
    monkeypatch.setattr(FakeWorker, "command", refusing)
    return r


def _live(h: Harness) -> list[FakeWorker]:
    return [w for w in h.spawned if w.state != WorkerState.DEAD]


def _job(h: Harness) -> Job:
    return h.engine.submit(JobRequest(model="m", prompt="x", n=2, width=64, height=64, steps=2, guidance=1.0,
                                      output_format="png", seed=1))


async def _runs_on_two_new_workers(h: Harness, job: Job) -> None:
    """``job`` (two outputs) loads the model anew, on two workers, and runs there."""
    await until(lambda: len([w for w in _live(h) if w.executed]) == 2)
    assert all(w.id > 1 for w in _live(h)), "new workers: the first two were stopped"
    for w in _live(h):
        w.finish(w.executed[-1])
    await h.settle(job)
    assert job.status == JobStatus.SUCCEEDED


async def test_a_move_into_host_memory_that_one_of_two_workers_refuses_ends_on_disk(refusals: Refusals) -> None:
    h = Harness(models=GPUS, device_memory="8GiB", host_memory="8GiB", max_batch=1)
    await h.engine.start()
    try:
        refusals.command = Sleep
        await h.engine.unload_model("m")
        await h.settle()
        status = h.engine.keeper.snapshot()["m"]
        assert _live(h) == [], "no worker left asleep and never woken, nor one awake beside it"
        assert status.residency == "disk" and status.per_device == {"cuda:0": 0, "cuda:1": 0}, status
        assert WHY in status.reason and h.engine.keeper.policy.host_used() == 0, status
        assert "m" not in h.engine.keeper.moving
        refusals.command = None
        await _runs_on_two_new_workers(h, _job(h))
    finally:
        await h.close()


async def test_a_move_into_host_memory_whose_answers_time_out_ends_on_disk(refusals: Refusals) -> None:
    """A SLEEP unanswered in time may still run in the worker, so the move may have been made: not "none moved"."""
    h = Harness(models=GPUS, device_memory="8GiB", host_memory="8GiB", max_batch=1)
    await h.engine.start()
    try:
        refusals.command, refusals.times_out = Sleep, True
        await h.engine.unload_model("m")
        await h.settle()
        assert _live(h) == [], "no worker left to fall asleep later, while the books say it is on its devices"
        status = h.engine.keeper.snapshot()["m"]
        assert status.residency == "disk" and "did not answer within" in status.reason, status
        assert "m" not in h.engine.keeper.moving and h.engine.keeper.policy.host_used() == 0
        refusals.command = None
        await _runs_on_two_new_workers(h, _job(h))
    finally:
        await h.close()


async def test_a_load_from_host_memory_that_one_of_two_workers_refuses_fails_its_job_and_leaves_no_worker(
        refusals: Refusals) -> None:
    h = Harness(models=GPUS, device_memory="8GiB", host_memory="8GiB", max_batch=1)
    await h.engine.start()
    try:
        await h.engine.unload_model("m")
        assert h.engine.keeper.snapshot()["m"].residency == "host"
        refusals.command = Wake
        failed = _job(h)
        await h.settle(failed)
        assert failed.status == JobStatus.FAILED and failed.error is not None
        assert failed.error["code"] == ErrorCode.MODEL_LOAD_FAILED and WHY in failed.error["message"], failed.error
        await h.settle()
        assert _live(h) == [], "the worker whose wake failed holds part of its weights no longer"
        status = h.engine.keeper.snapshot()["m"]
        assert status.residency == "disk" and h.engine.keeper.policy.host_used() == 0, status
        refusals.command = None
        await _runs_on_two_new_workers(h, _job(h))
    finally:
        await h.close()


async def test_a_daemon_sleep_that_one_of_a_cpu_models_two_workers_refuses_lets_its_jobs_run_after_the_wake(
        refusals: Refusals) -> None:
    h = Harness(models=CPUS, max_batch=1)
    await h.engine.start()
    try:
        refusals.command = Sleep
        with pytest.raises(PowerFailed) as failed:
            await h.engine.sleep(1)
        assert WHY in failed.value.message and "asleep at level 1" in failed.value.message, failed.value.message
        assert not [w for w in h.spawned if w.state == WorkerState.SLEEPING], "none left asleep, never woken"
        waiting = _job(h)
        await h.settle()
        assert not waiting.terminal, "it waits for the wake"
        refusals.command = None
        await h.engine.wake()
        await _runs_on_two_new_workers(h, waiting)
    finally:
        await h.close()


async def test_a_daemon_wake_that_one_of_a_cpu_models_two_workers_refuses_leaves_none_half_woken(
        refusals: Refusals) -> None:
    h = Harness(models=CPUS, max_batch=1)
    await h.engine.start()
    try:
        await h.engine.sleep(1)
        assert [w.state for w in h.spawned] == [WorkerState.SLEEPING] * 2, "paused in place"
        refusals.command = Wake
        with pytest.raises(PowerFailed) as failed:
            await h.engine.wake()
        assert failed.value.code == ErrorCode.WAKE_FAILED and WHY in failed.value.message, failed.value.message
        await h.settle()
        assert not [w for w in h.spawned if w.state == WorkerState.SLEEPING], "none left asleep, never woken"
        assert h.engine.keeper.snapshot()["m"].residency == "disk"
        refusals.command = None
        await _runs_on_two_new_workers(h, _job(h))
    finally:
        await h.close()
