"""Room for the batch that runs, not for its first output: the engine asked residency at
batch 1 and then sent a batch of up to ``--max-batch``, so a model was let run a batch of 4 beside an idle model
whose room that batch needed, past ``--device-memory``."""

from __future__ import annotations

import asyncio

import pytest
from enginekit import FakeWorker, Harness, hold_starts, until
from residencykit import G

from diffusiond.daemon.config import ModelConfig
from diffusiond.daemon.core.jobs import JobRequest
from diffusiond.daemon.residency.working import Shape
from diffusiond.protocol import JobStatus, WorkerState


def _two_models(monkeypatch: pytest.MonkeyPatch) -> Harness:
    """a and b, 2 GiB of weights each, in a 6 GiB budget, batches of up to 4."""
    hold_starts(monkeypatch, weight_bytes=2 * G).set()
    return Harness(models=tuple(ModelConfig(name=n, spec="fake", devices=("cuda:0",)) for n in "ab"),
                   device_memory="6GiB", host_memory="0", max_batch=4)


def _worker(h: Harness, model: str) -> FakeWorker:
    return [w for w in h.spawned if w.config.model_name == model][-1]


async def test_an_idle_model_leaves_for_the_batch_that_runs_not_only_for_its_first_output(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """a and b, 2 GiB each, share a 6 GiB budget: a's batch of 1 needs 1 GiB beside them (measured), its batch of 4
    3 GiB, which only b's leaving makes. b leaves before the batch of 4 is sent, and the batch holds its 3 GiB."""
    h = _two_models(monkeypatch)
    await h.engine.start()
    try:
        keeper = h.engine.keeper
        assert {s.name: s.residency for s in keeper.snapshot().values()} == {"a": "device", "b": "device"}
        keeper.policy.measured("a", Shape(64, 64, 1), G)  # as a worker's COMPUTE_DONE reports each shape's peak
        keeper.policy.measured("a", Shape(64, 64, 4), 3 * G)
        job = h.engine.submit(JobRequest(model="a", prompt="x", n=4, width=64, height=64, steps=2, guidance=1.0,
                                         output_format="png", seed=1))
        a = _worker(h, "a")
        await until(lambda: bool(a.executed))
        assert [len(b.requests) for b in a.executed] == [4], "the four outputs go as one batch"
        assert keeper.snapshot()["b"].residency == "disk" and _worker(h, "b").state == WorkerState.DEAD, \
            "b, idle, left the device before the batch that needs its room was sent"
        assert keeper.snapshot()["a"].per_device == {"cuda:0": 5 * G}, "its weights and the batch's 3 GiB"
        assert keeper.policy.device_used("cuda:0") <= 6 * G
        a.finish(a.executed[0])
        await h.settle(job)
        assert job.status == JobStatus.SUCCEEDED
    finally:
        await h.close()


async def test_a_batch_waits_for_another_models_run_to_give_its_room_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """b runs a batch (1 GiB) beside a: a's batch of 1 would fit in what is left, its batch of 4 (2 GiB) does not,
    so it is sent only once b's run has ended, and then as one batch of 4 within the budget."""
    h = _two_models(monkeypatch)
    await h.engine.start()
    try:
        keeper = h.engine.keeper
        keeper.policy.measured("b", Shape(64, 64, 1), G)
        keeper.policy.measured("a", Shape(64, 64, 1), G // 2)
        keeper.policy.measured("a", Shape(64, 64, 4), 2 * G)
        b_job = h.engine.submit(JobRequest(model="b", prompt="x", n=1, width=64, height=64, steps=2, guidance=1.0,
                                           output_format="png", seed=1))
        b = _worker(h, "b")
        await until(lambda: bool(b.executed))
        a_job = h.engine.submit(JobRequest(model="a", prompt="x", n=4, width=64, height=64, steps=2, guidance=1.0,
                                           output_format="png", seed=1))
        a = _worker(h, "a")
        for _ in range(5):
            await asyncio.sleep(0)
        assert not a.executed, "a batch of 4 needs b's running memory: it is not sent beside b's run"
        assert a_job.stage_label == "waiting_for_memory"
        b.finish(b.executed[0])
        await h.settle(b_job)
        await until(lambda: bool(a.executed))
        assert [len(x.requests) for x in a.executed] == [4]
        assert keeper.snapshot()["b"].residency == "device", "b stays: its run's end gave the room back"
        assert keeper.policy.device_used("cuda:0") == 6 * G
        a.finish(a.executed[0])
        await h.settle(a_job)
        assert a_job.status == JobStatus.SUCCEEDED
    finally:
        await h.close()
