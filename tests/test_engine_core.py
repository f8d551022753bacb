"""The engine's transitions, in-process against fake workers (tests/enginekit.py): every ending
of a job, deadlines in each stage, worker loss and replacement, drain, cancel races, slots.

The same behaviour is checked end to end against real processes in test_daemon_lifecycle.py,
test_hardening.py, test_hardening_shutdown.py and test_faults.py; here each case runs in
milliseconds and can order the worker's frames exactly as the case needs."""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
from enginekit import Harness, image
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diffusiond.daemon import errors
from diffusiond.daemon.core.jobs import Job
from diffusiond.daemon.workers.link import WorkerStartError
from diffusiond.ipc.messages import Sleep, Wake
from diffusiond.protocol import ErrorCode, Event, JobStatus, WorkerState


@pytest.fixture
async def h() -> AsyncIterator[Harness]:
    harness = Harness()
    await harness.engine.start()
    yield harness
    await harness.close()


def events_of(job: Job) -> list[Event]:
    seen: list[Event] = []
    job.listeners.add(lambda e, j: seen.append(e))
    return seen


async def read(h: Harness, job: Job, k: int) -> bytes:
    async with h.engine.open_output(job, k) as r:
        data = bytes(r.header) + bytes(r.payload)
        r.complete = True
    return data


async def test_a_batch_of_two_succeeds_and_every_slot_goes_back_after_encoding(h: Harness) -> None:
    job = h.submit(n=2)
    seen = events_of(job)
    [batch] = h.worker.executed
    assert [r.request_id for r in batch.requests] == [f"{job.id}/0", f"{job.id}/1"]
    assert [r.seed for r in batch.requests] == [7, 8]
    assert job.status == JobStatus.RUNNING
    h.worker.progress(batch, 1)
    h.worker.finish(batch)
    await h.settle(job)
    assert job.status == JobStatus.SUCCEEDED and job.error is None
    assert seen[0] == Event.PROGRESS and seen[-1] == Event.DONE
    assert h.worker.held == {} and sorted(h.worker.returned) == [0, 1]
    pixels = image(await read(h, job, 0))
    assert pixels.shape == (64, 64, 3) and (pixels == 128).all()
    assert set(job.timings_ms) >= {"queued", "compute", "copy", "encode", "total"}


async def test_npy_output_is_served_from_the_slot_once_then_the_slot_goes_back(h: Harness) -> None:
    job = h.submit(output_format="npy")
    h.worker.finish(h.worker.executed[0])
    await h.settle(job)
    assert job.status == JobStatus.SUCCEEDED
    assert h.worker.held, "an npy output is served from shared memory, so its slot is still held"
    data = await read(h, job, 0)
    assert data.startswith(b"\x93NUMPY") and len(data) > 64 * 64 * 3
    assert h.worker.held == {}
    with pytest.raises(errors.OutputReleased):
        await read(h, job, 0)


async def test_an_unfinished_read_keeps_the_npy_output_for_the_next_reader(h: Harness) -> None:
    job = h.submit(output_format="npy")
    h.worker.finish(h.worker.executed[0])
    await h.settle(job)
    async with h.engine.open_output(job, 0) as r:
        assert len(r) > 64 * 64 * 3  # the client went away before the last byte
    assert h.worker.held
    assert (await read(h, job, 0)).startswith(b"\x93NUMPY")


async def test_output_index_and_readiness_are_checked(h: Harness) -> None:
    job = h.submit()
    with pytest.raises(errors.OutputNotFound):
        await read(h, job, 1)
    with pytest.raises(errors.OutputNotReady) as exc:
        await read(h, job, 0)
    assert exc.value.stage == "computing"


async def test_cancel_while_queued_never_reaches_a_worker() -> None:
    h = Harness(max_batch=1)
    await h.engine.start()
    _, second, third = h.submit(), h.submit(), h.submit()
    assert len(h.worker.executed) == 2  # one computing, one waiting; the third is queued
    h.engine.cancel(third.id)
    assert third.status == JobStatus.CANCELLED and third.error == {
        "code": "cancelled", "message": "cancelled by the client", "stage": "queued"}
    assert h.engine.scheduler.depth == 0
    for batch in list(h.worker.executed):
        h.worker.finish(batch)
    await h.settle(second)
    assert len(h.worker.executed) == 2 and h.worker.cancelled == []
    with pytest.raises(errors.JobFinished):
        h.engine.cancel(third.id)
    await h.close()


async def test_cancel_while_computing_asks_the_worker_and_a_late_output_goes_straight_back(h: Harness) -> None:
    job = h.submit()
    [batch] = h.worker.executed
    h.engine.cancel(job.id)
    assert h.worker.cancelled == [f"{job.id}/0"]
    h.worker.finish(batch)  # the output was already on its way
    await h.settle()
    assert job.status == JobStatus.CANCELLED
    assert h.worker.held == {} and h.worker.returned == [0]
    assert not h.engine.flights.batches


@pytest.mark.parametrize("stage", ["queued", "computing", "copying"])
async def test_deadline_names_the_stage_and_the_worker(stage: str) -> None:
    h = Harness(max_batch=1)
    await h.engine.start()
    if stage == "queued":
        h.submit(), h.submit()  # the worker holds two batches; ours waits behind them
    job = h.submit(timeout_s=0.05)
    if stage == "copying":
        h.worker.compute_done(h.worker.executed[-1])
    await h.settle(job)
    assert job.status == JobStatus.FAILED
    assert job.error is not None and job.error["code"] == "deadline_exceeded" and job.error["stage"] == stage
    assert "0.05s" in job.error["message"]
    if stage != "queued":
        assert "fake worker 0" in job.error["message"]
        assert h.worker.cancelled == [f"{job.id}/0"]
    await h.close()


async def test_a_failed_request_fails_its_job_and_the_others_outputs_go_back(h: Harness) -> None:
    job = h.submit(n=2)
    [batch] = h.worker.executed
    h.worker.compute_done(batch)
    h.worker.fail(batch, 0, "CUDA out of memory")
    h.worker.output(batch, 1)
    await h.settle(job)
    assert job.status == JobStatus.FAILED
    assert job.error == {"code": "generation_failed", "message": "CUDA out of memory (on fake worker 0)",
                         "stage": "computing"}
    await h.settle()
    assert h.worker.held == {}


async def test_worker_loss_fails_only_unfinished_work_and_the_pool_replaces_it(h: Harness) -> None:
    done = h.submit(output_format="npy")
    h.worker.finish(h.worker.executed[0])
    await h.settle(done)
    lost = h.submit()
    first = h.worker
    first.die()
    assert lost.status == JobStatus.FAILED
    assert lost.error is not None and lost.error["code"] == "worker_lost"
    assert lost.error["message"] == "fake worker 0 was killed by signal SIGKILL while the job was computing"
    assert done.status == JobStatus.SUCCEEDED
    assert (await read(h, done, 0)).startswith(b"\x93NUMPY")  # still readable: the mapping outlives the worker
    for _ in range(20):
        await asyncio.sleep(0.01)
        if len(h.spawned) == 2 and h.worker.state == WorkerState.READY:
            break
    assert len(h.spawned) == 2 and h.worker is not first
    assert h.engine.pool.models["m"].restarts == 1
    again = h.submit()
    h.worker.finish(h.worker.executed[0])
    await h.settle(again)
    assert again.status == JobStatus.SUCCEEDED


async def test_jobs_are_admitted_while_the_only_worker_is_being_replaced(h: Harness) -> None:
    h.worker.die()
    job = h.submit()  # waits for the replacement instead of failing
    await asyncio.sleep(0.05)
    h.worker.finish(h.worker.executed[0])
    await h.settle(job)
    assert job.status == JobStatus.SUCCEEDED


async def test_drain_fails_what_is_left_and_refuses_new_jobs(h: Harness) -> None:
    job = h.submit()
    await h.engine.drain(0.05)
    assert job.status == JobStatus.FAILED
    assert job.error is not None and job.error["code"] == "shutting_down" and job.error["stage"] == "computing"
    with pytest.raises(errors.NotAccepting) as exc:
        h.submit()
    assert exc.value.retry_after_s == 5


async def test_drain_lets_running_jobs_finish_within_the_grace(h: Harness) -> None:
    job = h.submit()
    drain = asyncio.ensure_future(h.engine.drain(5.0))
    await asyncio.sleep(0.01)
    h.worker.finish(h.worker.executed[0])
    await asyncio.wait_for(drain, 5)
    assert job.status == JobStatus.SUCCEEDED


async def test_queue_full_is_refused_with_a_retry_hint() -> None:
    h = Harness(max_batch=1, queue_size=1)
    await h.engine.start()
    h.submit(), h.submit(), h.submit()  # two on the worker, one queued: the queue's limit
    with pytest.raises(errors.QueueFull) as exc:
        h.submit()
    assert exc.value.retry_after_s == 1 and exc.value.code == ErrorCode.QUEUE_FULL
    await h.close()


async def test_unknown_model_and_job_are_domain_errors(h: Harness) -> None:
    with pytest.raises(errors.ModelNotFound) as exc:
        h.engine.model("nope")
    assert exc.value.field == "model" and "models: m" in exc.value.message
    with pytest.raises(errors.JobNotFound):
        h.engine.get("j_missing")


async def test_sleep_waits_for_running_work_and_nothing_is_dispatched_until_wake(h: Harness) -> None:
    job = h.submit()
    sleeping = asyncio.ensure_future(h.engine.sleep())
    await asyncio.sleep(0.02)
    assert not sleeping.done() and not any(isinstance(c, Sleep) for c in h.worker.commands)
    h.worker.finish(h.worker.executed[0])
    await asyncio.wait_for(sleeping, 5)
    assert job.status == JobStatus.SUCCEEDED and h.worker.state == WorkerState.SLEEPING
    waiting = h.submit()
    assert len(h.worker.executed) == 1 and waiting.status == JobStatus.QUEUED
    await h.engine.wake()
    assert isinstance(h.worker.commands[-1], Wake) and len(h.worker.executed) == 2


async def test_a_model_that_cannot_load_fails_start_with_the_workers_reason() -> None:
    h = Harness(fail_starts=["loading model 'm' failed: no such folder"])
    with pytest.raises(WorkerStartError, match="no such folder"):
        await h.engine.start()
    assert not h.engine.accepting
    await h.close()


async def test_a_waiting_copy_gets_room_by_spilling_the_unfetched_output_beside_the_free_range(h: Harness) -> None:
    """The two outputs lie at the arena's start, the newer one against the free range: only its slot, spilled,
    makes that range long enough (the oldest's would be free apart from it; tests/test_outputs_fragmented_room.py)."""
    jobs = [h.submit(output_format="npy") for _ in range(2)]
    for j, batch_no in zip(jobs, range(2), strict=True):  # a busy worker is sent only full batches
        h.worker.finish(h.worker.executed[batch_no])
        await h.settle(j)
    assert len(h.worker.held) == 2
    h.worker.slot_wait(h.worker.arena_capacity - h.worker.held_bytes + 1)  # needs one output's room
    for _ in range(50):
        await asyncio.sleep(0.01)
        if len(h.worker.held) == 1:
            break
    assert h.worker.returned == [1], "the output beside the free range was spilled, and only it"
    spilled = np.load(io.BytesIO(await read(h, jobs[1], 0)))
    assert spilled.shape == (64, 64, 3) and (spilled == 128).all()
    with pytest.raises(errors.OutputReleased):  # the spilled copy is delivered once, as its slot
        await read(h, jobs[1], 0)
    assert jobs[1].items[0].data is None


async def test_an_output_read_while_it_is_being_spilled_keeps_no_copy(h: Harness) -> None:
    """A read that completes while the spill copies the slot was the output's one delivery: the spill's
    copy is not kept (before, it was, and served again until retention ended)."""
    jobs = [h.submit(output_format="npy") for _ in range(2)]
    for j, batch_no in zip(jobs, range(2), strict=True):
        h.worker.finish(h.worker.executed[batch_no])
        await h.settle(j)
    item = jobs[1].items[0]  # the one whose slot makes room (the test above)
    h.worker.slot_wait(h.worker.arena_capacity - h.worker.held_bytes + 1)
    await asyncio.sleep(0)  # the spill's task starts, and waits for its copy
    assert item.spilling
    await read(h, jobs[1], 0)  # never yields to the loop: done before the copy comes back
    for _ in range(50):
        await asyncio.sleep(0.01)
        if not item.spilling:
            break
    assert not item.spilling and item.data is None and h.worker.returned == [1]
    with pytest.raises(errors.OutputReleased):
        await read(h, jobs[1], 0)


async def test_retention_end_gives_every_slot_back() -> None:
    h = Harness(retention_s=0.02)
    await h.engine.start()
    job = h.submit(output_format="npy")
    h.worker.finish(h.worker.executed[0])
    await h.settle(job)
    await asyncio.sleep(0.1)
    assert h.worker.held == {}
    with pytest.raises(errors.JobNotFound):
        h.engine.get(job.id)
    await h.close()


async def test_a_duplicate_output_frame_is_given_back_not_served_twice(h: Harness) -> None:
    job = h.submit(output_format="npy")
    [batch] = h.worker.executed
    h.worker.finish(batch)
    h.worker.output(batch, 0)  # a second OUTPUT_READY for the same request
    await h.settle(job)
    assert h.worker.returned == [1] and list(h.worker.held) == [0]


# Any interleaving: the worker's frames, cancels, worker deaths and new jobs in any order -------
ACTIONS = st.lists(st.one_of(
    st.tuples(st.just("submit"), st.integers(1, 3), st.sampled_from(["png", "npy"])),
    st.tuples(st.just("cancel"), st.integers(0, 20)),
    st.tuples(st.sampled_from(["finish", "compute_done", "output", "fail", "progress"]), st.integers(0, 5)),
    st.tuples(st.just("die")),
    st.tuples(st.just("settle")),
), max_size=40)


async def play(actions: list[tuple[Any, ...]]) -> None:
    h = Harness(max_batch=2, queue_size=8, job_timeout_s=30)
    await h.engine.start()
    jobs: list[Job] = []
    for action in actions:
        kind = action[0]
        w = h.worker
        batches = [b for b in w.executed if b.batch_id in h.engine.flights.batches]
        if kind == "submit":
            try:
                jobs.append(h.submit(n=action[1], output_format=action[2]))
            except (errors.QueueFull, errors.NoWorker):
                pass
        elif kind == "cancel" and jobs:
            job = jobs[action[1] % len(jobs)]
            if not job.terminal:
                h.engine.cancel(job.id)
        elif kind == "die" and w.state == WorkerState.READY:
            w.die()
        elif kind == "settle":
            for _ in range(20):
                await asyncio.sleep(0)
        elif batches and w.state == WorkerState.READY:
            batch = batches[action[1] % len(batches)]
            k = action[1] % len(batch.requests)
            if kind == "finish":
                w.finish(batch)
            elif kind == "compute_done":
                w.compute_done(batch)
            elif kind == "output":
                w.output(batch, k)
            elif kind == "fail":
                w.fail(batch, k)
            else:
                w.progress(batch, 1)
    await asyncio.sleep(0.05)  # encodes in flight land; replacements start
    await h.engine.drain(0)
    for job in jobs:
        assert job.terminal, job.id
        if job.status != JobStatus.SUCCEEDED:
            assert job.error and job.error["code"] and job.error["message"] and job.error["stage"]
    await h.close()
    leaked = {w.name: w.held for w in h.spawned if w.held}
    assert not leaked, f"slots never given back: {leaked}"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(actions=ACTIONS)
def test_any_interleaving_ends_every_job_with_a_reason_and_gives_every_slot_back(
        actions: list[tuple[Any, ...]]) -> None:
    asyncio.run(play(actions))



async def test_edits_reach_the_worker_by_fd_and_each_input_is_closed_when_its_job_ends(h: Harness) -> None:
    from diffusiond.daemon.core.inputs import EditInput
    from diffusiond.ipc.inputs import InputBuffer
    from diffusiond.protocol import Task

    def edit(value: int, masked: bool) -> EditInput:
        img = np.full((64, 64, 3), value, np.uint8)
        mask = np.full((64, 64, 1), 255, np.uint8) if masked else None
        return EditInput(Task.INPAINTING if masked else Task.IMAGE_TO_IMAGE, 0.5, InputBuffer(img, mask), 64, 64)

    a, b, c = edit(10, False), edit(20, False), edit(30, True)
    first, second = h.submit(n=2, edit=a), h.submit(edit=b)
    batch = h.worker.executed[0]
    assert batch.params.edit == "image-to-image" and batch.params.strength == 0.5
    got = h.worker.inputs[0]
    assert [int(x[0][0, 0, 0]) for x in got if x is not None] == [10, 10]  # the second job waits: a busy worker
    h.worker.finish(batch)
    await h.settle(first)
    assert first.status == JobStatus.SUCCEEDED and a.buffer.fd == -1  # closed at its end
    await h.settle()
    assert [int(x[0][0, 0, 0]) for x in h.worker.inputs[1] if x is not None] == [20]
    h.engine.cancel(second.id)  # a cancelled job's input goes too
    assert b.buffer.fd == -1
    h.worker.finish(h.worker.executed[1])  # its late output goes back; the worker is free
    await h.settle()
    inpaint = h.submit(edit=c)
    await h.settle()
    assert h.worker.executed[-1].params.edit == "inpainting"
    ((img, mask),) = [x for x in h.worker.inputs[-1] if x is not None]
    assert mask is not None and int(img[0, 0, 0]) == 30 and int(mask[0, 0, 0]) == 255
    h.engine.cancel(inpaint.id)
    assert c.buffer.fd == -1


async def test_a_resumed_job_for_a_model_the_preload_leaves_on_disk_is_loaded_for_at_once(tmp_path: Any) -> None:
    """With a budget for one model, a restart's preload loads ``a`` and leaves ``b`` on disk (their sizes
    remembered). A job for ``b`` the last run left queued must start b's load as soon as the start is
    done: no READY of b's comes to dispatch it, and without one it waited for a's keep-alive (forever at
    -1). Found by test_residency_daemon.py's SIGKILL during a load."""
    import msgspec
    from enginekit import CAPS

    from diffusiond.daemon.config import ModelConfig
    from diffusiond.daemon.residency.units import FOREVER
    from diffusiond.daemon.state.store import SqliteStore

    models = (ModelConfig(name="a", spec="fake-a"), ModelConfig(name="b", spec="fake-b"))
    first = Harness(models=models, store=SqliteStore(tmp_path))
    await first.engine.start()
    job = first.submit(model="b")
    await first.engine.store.add(job)  # what ``accept`` adds before the 202
    await first.settle()
    await first.close()  # as a crash leaves it: the job is live in the state dir

    again = Harness(models=models, store=SqliteStore(tmp_path), device_memory="150", keep_alive_s=FOREVER)
    for m in again.engine.models():  # remembered from the last run: 100 bytes each, so one fits
        m.capabilities, m.known = msgspec.structs.replace(CAPS, weight_bytes=100), True
    await again.engine.start()
    assert not any(w.config.model_name == "b" for w in again.spawned), "b stays on disk at start"

    async def b_ran() -> bool:
        while not any(w.config.model_name == "b" and w.executed for w in again.spawned):
            await asyncio.sleep(0.01)
        return True

    assert await asyncio.wait_for(b_ran(), 5), "the resumed job never reached b"
    worker = next(w for w in again.spawned if w.config.model_name == "b")
    worker.finish(worker.executed[0])
    resumed = again.engine.jobs[job.id]
    await again.settle(resumed)
    assert resumed.status == JobStatus.SUCCEEDED
    await again.close()


async def test_a_model_nothing_fits_refuses_every_job_with_what_was_tried() -> None:
    """offload=auto found no configuration within the budget (config.py): the model's jobs are refused at
    admission with that list, instead of queueing for a load that cannot fit."""
    from diffusiond.daemon.config import ModelConfig

    tried = "nothing fits the --device-memory budget of 1 GiB with offload=auto: none (offload=none) needs 30 GiB"
    h = Harness(models=(ModelConfig(name="m", spec="fake", nothing_fits=tried),), device_memory="1GiB")
    await h.engine.start()
    try:
        with pytest.raises(errors.ModelTooLarge) as refused:
            h.submit()
        assert tried in str(refused.value) and "model 'm' cannot run on cpu" in str(refused.value)
        assert h.engine.scheduler.depth == 0 and not any(w.executed for w in h.spawned)
    finally:
        await h.close()
