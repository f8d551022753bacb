"""Moves against jobs, with the engine and fake workers on a fake GPU (``cuda:0``), where a job could
run on a model that was then sent away under it, or wait forever:

- a decision's moves were booked in a task's first step, or (an unload by hand) one after another as each ended;
  a job admitted in between was dispatched to a model the decision had already sent away;
- a wake from host memory that failed left the worker asleep while the books said "on disk": the next job's load
  started no worker (the device had one) and its jobs waited for one that never came.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
from enginekit import KIND_OF, FakeWorker, Harness, hold_starts, job, until
from residencykit import G

from diffusiond.daemon.config import ModelConfig
from diffusiond.daemon.workers.link import Command
from diffusiond.ipc.messages import Ack, Sleep, Wake
from diffusiond.protocol import ErrorCode, JobStatus, WorkerState


@pytest.fixture
def weighs_a_gib(monkeypatch: pytest.MonkeyPatch) -> None:
    hold_starts(monkeypatch, weight_bytes=G).set()


def _worker(h: Harness, model: str) -> FakeWorker:
    return next(w for w in reversed(h.spawned) if w.config.model_name == model and w.state != WorkerState.DEAD)


async def _served(h: Harness, model: str, j: object) -> None:
    """Finish the batch one of ``model``'s workers is given, and wait for ``j`` to end."""
    def running() -> list[FakeWorker]:
        return [w for w in h.spawned if w.config.model_name == model and w.executed and w.state != WorkerState.DEAD]

    await until(lambda: bool(running()))
    w = running()[-1]
    w.finish(w.executed[-1])
    await h.settle(j)  # type: ignore[arg-type]


async def test_a_job_sent_during_an_unload_by_hand_waits_for_it_and_runs_after(
        weighs_a_gib: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """x's unload first drops y from host memory (its worker stops slowly) to make room for x there; a job for x sent
    meanwhile ran on x, which was then put to sleep under it."""
    dropped = asyncio.Event()
    stop = FakeWorker.stop

    async def slow_stop(self: FakeWorker, timeout: float) -> None:
        if self.config.model_name == "y":
            await dropped.wait()
        await stop(self, timeout)

    monkeypatch.setattr(FakeWorker, "stop", slow_stop)
    h = Harness(models=tuple(ModelConfig(name=n, spec="fake", devices=("cuda:0",)) for n in "yx"),
                device_memory="8GiB", host_memory="1GiB", max_batch=1)
    await h.engine.start()
    try:
        await h.engine.unload_model("y")  # y waits in host memory, which it fills
        x = _worker(h, "x")
        unloading = asyncio.ensure_future(h.engine.unload_model("x"))
        await until(lambda: "y" in h.engine.keeper.moving)  # y's worker is stopping
        await h.settle()
        waiting = job(h, "x")
        await h.settle()
        assert not x.executed, "the job was dispatched to x, whose move to host memory is under way"
        dropped.set()
        await unloading
        assert any(isinstance(c, Sleep) for c in x.commands)
        await _served(h, "x", waiting)
        assert waiting.status == JobStatus.SUCCEEDED, waiting.error
    finally:
        dropped.set()
        await h.close()


async def test_a_job_admitted_as_its_model_expires_runs_after_it_left(weighs_a_gib: None) -> None:
    """The expiry's moves were booked in their task's first step: a job whose admission was already on the loop ran
    on the model, whose worker was then stopped under its batch."""
    h = Harness(models=(ModelConfig(name="x", spec="fake", devices=("cuda:0",)),), device_memory="8GiB",
                host_memory="0", keep_alive_s=0.0, max_batch=1)
    await h.engine.start()
    try:
        first = _worker(h, "x")
        policy = h.engine.keeper.policy
        expired = policy.expired
        sent: list[object] = []

        def expire_and_race(now: float) -> object:
            moves = expired(now)
            if moves and not sent:  # a request for x arrives in the same turn of the loop
                asyncio.get_running_loop().call_soon(lambda: sent.append(job(h, "x")))
            return moves

        policy.expired = expire_and_race  # type: ignore[method-assign]
        await until(lambda: bool(sent))
        await h.settle()
        assert not first.executed, "the job ran on the worker its model's expiry stops"
        await until(lambda: first.state == WorkerState.DEAD)
        await _served(h, "x", sent[0])
        assert sent[0].status == JobStatus.SUCCEEDED  # type: ignore[attr-defined]
    finally:
        await h.close()


async def test_a_failed_wake_fails_its_jobs_and_the_next_job_loads_the_model_from_disk(
        weighs_a_gib: None, monkeypatch: pytest.MonkeyPatch) -> None:
    command = FakeWorker.command
    refuse = [True]

    async def wake_fails(self: FakeWorker, msg: Command, timeout: float, fds: Sequence[int] = ()) -> Ack:
        if isinstance(msg, Wake) and refuse:
            refuse.clear()  # as a worker answers when the copy back runs out of memory: it stays asleep
            self.commands.append(msg)
            return Ack(KIND_OF[Wake], False, "OutOfMemoryError: CUDA out of memory", host_kept=self.host_kept)
        return await command(self, msg, timeout, fds)

    monkeypatch.setattr(FakeWorker, "command", wake_fails)
    h = Harness(models=(ModelConfig(name="x", spec="fake", devices=("cuda:0",)),), device_memory="8GiB",
                host_memory="4GiB", max_batch=1)
    await h.engine.start()
    try:
        await h.engine.unload_model("x")
        asleep = _worker(h, "x")
        assert asleep.state == WorkerState.SLEEPING
        failed = job(h, "x")
        await h.settle(failed)
        assert failed.status == JobStatus.FAILED and failed.error is not None
        assert failed.error["code"] == ErrorCode.MODEL_LOAD_FAILED and "out of memory" in failed.error["message"]
        assert asleep.state == WorkerState.DEAD, "the worker that could not wake holds its copy no longer"
        assert h.engine.keeper.snapshot()["x"].residency == "disk"
        again = job(h, "x")
        await _served(h, "x", again)
        assert again.status == JobStatus.SUCCEEDED and _worker(h, "x") is not asleep
    finally:
        await h.close()
