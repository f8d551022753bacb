"""Batching rules: bounded admission, oldest first, compatible items together, full batches for
busy workers, optional batch wait."""

from __future__ import annotations

import pytest

from diffusiond.daemon.core.jobs import Item, Job, JobRequest
from diffusiond.daemon.core.scheduler import Scheduler, Wait


def job(size: int = 64, n: int = 1, model: str = "m", at: float = 0.0) -> Job:
    j = Job(JobRequest(model=model, prompt="p", n=n, width=size, height=size, steps=2, guidance=1.0,
                       output_format="png"))
    j.items = [Item(j, i, seed=i, enqueued_at=at) for i in range(n)]
    return j


def ids(batch: object) -> list[str]:
    assert isinstance(batch, list)
    return [i.request_id for i in batch]


def test_scheduler_admission_is_bounded() -> None:
    s = Scheduler(queue_size=2, max_batch=4, batch_wait_s=0)
    s.admit(job())
    assert not s.full
    s.admit(job())
    assert s.full and s.depth == 2
    s.remove(next(iter(s._queued_jobs.values())))
    assert not s.full


def test_scheduler_batches_compatible_items_starting_from_the_oldest() -> None:
    s = Scheduler(queue_size=10, max_batch=3, batch_wait_s=0)
    a, b, c, d = job(64), job(128), job(64, n=2), job(64)
    for j in (a, b, c, d):
        s.admit(j)
    first = s.next_batch("m", now=1.0)
    assert ids(first) == [a.items[0].request_id, c.items[0].request_id, c.items[1].request_id]
    # the 128px job waited for exactly one batch: it heads the next one
    second = s.next_batch("m", now=1.0)
    assert ids(second) == [b.items[0].request_id]
    assert ids(s.next_batch("m", now=1.0)) == [d.items[0].request_id]
    assert s.next_batch("m", now=1.0) is None and s.depth == 0


def test_scheduler_busy_worker_gets_only_full_batches() -> None:
    s = Scheduler(queue_size=10, max_batch=2, batch_wait_s=0)
    s.admit(job())
    assert s.next_batch("m", now=0.0, partial_ok=False) is None  # one item: wait for company
    s.admit(job())
    assert len(s.next_batch("m", now=0.0, partial_ok=False)) == 2  # type: ignore[arg-type]


def test_scheduler_batch_wait_holds_a_partial_batch_until_its_oldest_item_waited() -> None:
    s = Scheduler(queue_size=10, max_batch=4, batch_wait_s=0.5)
    s.admit(job(at=10.0))
    got = s.next_batch("m", now=10.1)
    assert isinstance(got, Wait) and got.until == pytest.approx(10.5)
    assert len(s.next_batch("m", now=10.5)) == 1  # type: ignore[arg-type]


def test_scheduler_remove_takes_out_only_that_jobs_items() -> None:
    s = Scheduler(queue_size=10, max_batch=8, batch_wait_s=0)
    a, b = job(n=3), job(n=2)
    s.admit(a)
    s.admit(b)
    assert len(s.remove(a)) == 3 and s.depth == 1
    assert ids(s.next_batch("m", now=0)) == [i.request_id for i in b.items]
    assert s.remove(a) == []


def test_scheduler_models_do_not_mix() -> None:
    s = Scheduler(queue_size=10, max_batch=8, batch_wait_s=0)
    s.admit(job(model="x"))
    s.admit(job(model="y"))
    assert len(s.next_batch("x", now=0)) == 1  # type: ignore[arg-type]
    assert len(s.next_batch("y", now=0)) == 1  # type: ignore[arg-type]


def test_a_batch_takes_at_most_max_fds_edits_with_their_own_input_and_all_outputs_of_each() -> None:
    """Each edit's input image reaches the worker as one fd of the batch's frame, and a frame
    carries at most MAX_FDS: a batch takes outputs of at most that many edit jobs (however many
    outputs each has), and the rest wait for the next batch."""
    import numpy as np

    from diffusiond.daemon.core.inputs import EditInput
    from diffusiond.ipc.frames import MAX_FDS
    from diffusiond.ipc.inputs import InputBuffer
    from diffusiond.protocol import Task

    s = Scheduler(queue_size=100, max_batch=64, batch_wait_s=0)
    edits = []
    for k in range(MAX_FDS + 3):
        edit = EditInput(Task.IMAGE_TO_IMAGE, 0.5, InputBuffer(np.zeros((64, 64, 3), np.uint8)), 64, 64)
        j = Job(JobRequest(model="m", prompt="p", n=2, width=64, height=64, steps=2, guidance=1.0,
                           output_format="png", edit=edit))
        j.items = [Item(j, i, seed=k * 10 + i) for i in range(2)]
        s.admit(j)
        edits.append(j)
    try:
        first, second = s.next_batch("m", now=1.0), s.next_batch("m", now=1.0)
        assert isinstance(first, list) and isinstance(second, list)
        assert [i.job for i in first] == [j for j in edits[:MAX_FDS] for _ in range(2)]
        assert [i.job for i in second] == [j for j in edits[MAX_FDS:] for _ in range(2)]
    finally:
        for j in edits:
            assert j.request.edit is not None
            j.request.edit.close()
