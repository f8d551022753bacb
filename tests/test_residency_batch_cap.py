"""A batch that only fits smaller goes smaller: where nothing can make room for the batch the queue forms (the other
model on the device is pinned, or has work of its own), the batch sent is the largest that fits what is free, not
the full batch tried past ``--device-memory`` (or into an out-of-memory retry on a real GPU)."""

from __future__ import annotations

import pytest
from enginekit import FakeWorker, Harness, hold_starts, until
from residencykit import G

from diffusiond.daemon.config import ModelConfig
from diffusiond.daemon.core.jobs import Job, JobRequest
from diffusiond.daemon.residency.keeper import Keeper
from diffusiond.daemon.residency.working import Shape
from diffusiond.protocol import JobStatus


def _harness(monkeypatch: pytest.MonkeyPatch, *, pin_a: bool = False, **overrides: object) -> Harness:
    """a and b, 2 GiB of weights each, in a 6 GiB budget (2 GiB left for runs), batches of up to 4."""
    hold_starts(monkeypatch, weight_bytes=2 * G).set()
    return Harness(models=(ModelConfig(name="a", spec="fake", devices=("cuda:0",), pinned=pin_a),
                           ModelConfig(name="b", spec="fake", devices=("cuda:0",))),
                   device_memory="6GiB", host_memory="0", max_batch=4, **overrides)


def _measure_b(keeper: Keeper) -> None:
    """b's batch of 1 takes 0.5 GiB, of 2 1.5 GiB, of 4 3 GiB: in the 2 GiB beside both models' weights, 2 fit."""
    keeper.policy.measured("b", Shape(64, 64, 1), G // 2)
    keeper.policy.measured("b", Shape(64, 64, 2), 3 * G // 2)
    keeper.policy.measured("b", Shape(64, 64, 4), 3 * G)


def _worker(h: Harness, model: str) -> FakeWorker:
    return [w for w in h.spawned if w.config.model_name == model][-1]


def _submit(h: Harness, model: str, n: int) -> Job:
    return h.engine.submit(JobRequest(model=model, prompt="x", n=n, width=64, height=64, steps=2, guidance=1.0,
                                      output_format="png", seed=1))


async def _finish_all(h: Harness, worker: FakeWorker, job: Job) -> None:
    finished: list[object] = []
    while not job.terminal:
        await until(lambda: len(worker.executed) > len(finished) or job.terminal)
        for batch in worker.executed[len(finished):]:
            worker.finish(batch)
            finished.append(batch)
        await h.settle()
    await h.settle(job)


async def test_a_batch_beside_a_pinned_model_goes_as_large_as_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    """a is pinned, so nothing leaves for b's batch of 4 (3 GiB in 2 GiB): its four outputs go as two batches of 2,
    each within the budget, and the job succeeds."""
    h = _harness(monkeypatch, pin_a=True)
    await h.engine.start()
    try:
        keeper = h.engine.keeper
        _measure_b(keeper)
        job = _submit(h, "b", 4)
        b = _worker(h, "b")
        await until(lambda: bool(b.executed))
        assert [len(x.requests) for x in b.executed] == [2, 2], "the largest batch that fits, and the next behind it"
        assert keeper.policy.device_used("cuda:0") <= 6 * G
        assert keeper.snapshot()["a"].residency == "device"
        await _finish_all(h, b, job)
        assert job.status == JobStatus.SUCCEEDED
    finally:
        await h.close()


async def test_a_batch_beside_a_model_with_queued_work_goes_as_large_as_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    """a has a job queued (its batch waits for others to join: ``batch_wait``), so it does not leave, and runs nothing
    whose end would give memory back: b's four outputs go as batches of 2 within the budget."""
    h = _harness(monkeypatch, batch_wait_ms=60_000.0)
    await h.engine.start()
    try:
        keeper = h.engine.keeper
        _measure_b(keeper)
        a_job = _submit(h, "a", 1)
        job = _submit(h, "b", 4)
        b = _worker(h, "b")
        await until(lambda: bool(b.executed))
        assert not _worker(h, "a").executed and keeper.snapshot()["a"].queued == 1
        assert [len(x.requests) for x in b.executed] == [2, 2]
        assert keeper.policy.device_used("cuda:0") <= 6 * G
        await _finish_all(h, b, job)
        assert job.status == JobStatus.SUCCEEDED
        h.engine.cancel(a_job.id)
    finally:
        await h.close()


async def test_the_batch_behind_a_running_one_gets_its_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """b runs a batch of 2 (1.5 GiB of the 2 GiB left) beside pinned a when four more outputs come: the batch sent
    behind it runs once it is done, with its memory, so it is a batch of 2 too, neither 4 (past the budget) nor 1."""
    h = _harness(monkeypatch, pin_a=True)
    await h.engine.start()
    try:
        keeper = h.engine.keeper
        _measure_b(keeper)
        first = _submit(h, "b", 2)
        b = _worker(h, "b")
        await until(lambda: bool(b.executed))
        assert [len(x.requests) for x in b.executed] == [2]
        job = _submit(h, "b", 4)
        await until(lambda: len(b.executed) == 2)
        assert [len(x.requests) for x in b.executed] == [2, 2]
        await _finish_all(h, b, job)
        assert first.status == job.status == JobStatus.SUCCEEDED
    finally:
        await h.close()
