"""Room is made for the batch the scheduler sends, not for the model's whole queue: only outputs of one size and
parameters go together, so two queued jobs of different sizes go as two batches. Counted as one batch of two, the
queue sent an idle model away for a batch that never formed."""

from __future__ import annotations

import functools

import pytest
from enginekit import Harness, hold_starts, until
from residencykit import G

from diffusiond.daemon.config import ModelConfig
from diffusiond.daemon.core.jobs import Item, Job, JobRequest
from diffusiond.daemon.core.scheduler import Scheduler
from diffusiond.daemon.residency.working import Shape
from diffusiond.protocol import JobStatus, WorkerState


def _submit(h: Harness, side: int) -> Job:
    return h.engine.submit(JobRequest(model="a", prompt="x", n=1, width=side, height=side, steps=2, guidance=1.0,
                                      output_format="png", seed=1))


async def test_jobs_of_two_sizes_queued_together_send_no_idle_model_away(monkeypatch: pytest.MonkeyPatch) -> None:
    """a and b, 2 GiB each, in a 6 GiB budget: 2 GiB beside them, where each of a's two jobs (64 and 128 pixels a
    side, 1 GiB each) fits alone, and the two as one batch (3 GiB) would not. b, idle, stays."""
    hold_starts(monkeypatch, weight_bytes=2 * G).set()
    h = Harness(models=tuple(ModelConfig(name=n, spec="fake", devices=("cuda:0",)) for n in "ab"),
                device_memory="6GiB", host_memory="0", max_batch=4, batch_wait_ms=100)  # both queue before a batch
    await h.engine.start()
    try:
        keeper = h.engine.keeper
        keeper.policy.measured("a", Shape(64, 64, 1), G)
        keeper.policy.measured("a", Shape(64, 64, 2), 3 * G)
        keeper.policy.measured("a", Shape(128, 128, 1), G)
        assert h.engine.scheduler.forming("a") == 0
        small, large = _submit(h, 64), _submit(h, 128)
        assert h.engine.scheduler.forming("a") == 1, "the next batch takes the 64-pixel job alone"
        a = next(w for w in h.spawned if w.config.model_name == "a")
        b = next(w for w in h.spawned if w.config.model_name == "b")
        for sent in (1, 2):  # the 64-pixel batch, then the 128-pixel one, each of one output
            await until(functools.partial(lambda n: len(a.executed) == n, sent))
            assert len(a.executed[-1].requests) == 1, "one size a batch"
            a.finish(a.executed[-1])
        await h.settle(small)
        await h.settle(large)
        assert small.status == large.status == JobStatus.SUCCEEDED
        assert keeper.snapshot()["b"].residency == "device" and b.state == WorkerState.READY, \
            "b was not sent away for a batch of both sizes, which never forms"
        assert keeper.policy.device_used("cuda:0") <= 6 * G
    finally:
        await h.close()


def test_the_batch_forming_counts_its_heads_key_up_to_the_models_full_batch() -> None:
    s = Scheduler(queue_size=10, max_batch=8, batch_wait_s=0.0, sizes={"m": (1, 2, 4)})
    for side, n in ((64, 3), (128, 2), (64, 2)):
        job = Job(JobRequest(model="m", prompt="x", n=n, width=side, height=side, steps=2, guidance=1.0,
                             output_format="png"))
        job.items = [Item(job, i, seed=i, enqueued_at=0.0) for i in range(n)]
        s.admit(job)
    assert s.forming("m") == 4, "of the head's five 64-pixel outputs, the largest size up to 4"
    got = s.next_batch("m", 0.0)
    assert isinstance(got, list) and len(got) == 4
    assert s.forming("m") == 2, "the 128-pixel job heads the queue now (the 64-pixel output left waits behind it)"
    assert s.forming("other") == 0
