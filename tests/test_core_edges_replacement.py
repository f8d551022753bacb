"""A lost worker's replacement, against the engine with fake workers: one whose start keeps failing, one that
comes up while the daemon sleeps and does not go to sleep, the crash loop's back-off for a slow load, and what the
engine keeps for a worker stopped on purpose.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from enginekit import FakeWorker, Harness, until

from diffusiond.daemon.config import ModelConfig
from diffusiond.daemon.edge.views import model_state
from diffusiond.daemon.workers.link import Command, WorkerStartError
from diffusiond.daemon.workers.pool import REPLACE_ATTEMPTS
from diffusiond.ipc.messages import Ack, Ready, Sleep
from diffusiond.protocol import ErrorCode, JobStatus, ModelState, WorkerState

NO_CUDA = "CUDA error: no CUDA-capable device is detected"


async def test_a_replacement_that_keeps_failing_fails_the_waiting_jobs_with_why_and_stops_being_tried() -> None:
    """It was retried for good, and a job admitted meanwhile waited for it, then failed at its deadline saying only
    that. Now the job fails with the start's reason; after a few tries the model is ``unavailable`` with it, and a
    new job loads it anew."""
    h = Harness(fail_starts=[None] + [NO_CUDA] * REPLACE_ATTEMPTS)
    await h.engine.start()
    model = h.engine.pool.models["m"]
    h.worker.die()
    job = h.submit(timeout_s=60)  # admitted: the worker is on its way back
    await h.settle(job)
    assert job.status == JobStatus.FAILED and job.error is not None
    assert job.error["code"] == ErrorCode.MODEL_LOAD_FAILED and NO_CUDA in job.error["message"], job.error
    await until(lambda: model.replacing == 0, what="the pool to stop trying")
    assert len(h.spawned) == 1 + REPLACE_ATTEMPTS
    assert model_state(h.engine, model) == ModelState.UNAVAILABLE and NO_CUDA in h.engine.keeper.failed["m"]
    again = h.submit()  # its files were fixed meanwhile: this job loads it
    await until(lambda: bool(h.worker.executed), what="the model's load for the new job")
    h.worker.finish(h.worker.executed[0])
    await h.settle(again)
    assert again.status == JobStatus.SUCCEEDED
    await h.close()


async def test_a_replacement_that_does_not_go_to_sleep_with_the_daemon_is_stopped_saying_why(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A replacement that came up during a level-1 sleep was told to sleep within the drain grace; when it did not
    answer, its start counted as failed, logged with nothing after the colon, and the worker stayed awake among
    the model's workers, holding the device the sleep promised free."""
    h = Harness()
    await h.engine.start()
    await h.engine.sleep(1)
    first = h.worker
    plain = FakeWorker.command

    async def command(self: FakeWorker, msg: Command, timeout: float, fds: Sequence[int] = ()) -> Ack:
        if isinstance(msg, Sleep) and self is not first:
            raise TimeoutError  # a large model's SLEEP, longer than it was given
        return await plain(self, msg, timeout, fds)

    monkeypatch.setattr(FakeWorker, "command", command)
    first.die()
    model = h.engine.pool.models["m"]
    await until(lambda: model.replacing == 0, what="the pool to stop trying")
    assert not any(w.state == WorkerState.READY for w in model.workers)
    assert all(w.asked_to_stop for w in h.spawned[1:]), "a replacement that stayed awake was left running"
    assert "it came up while the daemon sleeps at level 1 and did not go to sleep: fake worker 1 did not answer " \
           "within" in caplog.text
    await h.close()


async def test_the_crash_loops_back_off_grows_for_a_model_that_loads_slowly() -> None:
    """A worker that dies right after its READY is a crash loop however long its load took: measured from its
    spawn, a model loading for over a minute never grew the back-off."""
    h = Harness()
    await h.engine.start()
    model = h.engine.pool.models["m"]
    for streak in (1, 2):
        worker = h.worker
        worker.started_at -= 120  # spawned two minutes ago; READY just now
        worker.die()
        assert model.crash_streak == streak
        await until(lambda w=worker: h.worker is not w and h.worker.state == WorkerState.READY,  # type: ignore[misc]
                    what="the replacement")
    await h.close()


async def test_a_worker_stopped_on_purpose_leaves_nothing_behind_in_the_engine() -> None:
    """Entries for the workers that ran batches went only with a loss: one per worker a residency unload or a
    level-2 sleep stopped, for the daemon's life."""
    h = Harness()
    await h.engine.start()
    job = h.submit()
    await until(lambda: bool(h.worker.executed))
    h.worker.finish(h.worker.executed[0])
    await h.settle(job)
    worker: Any = h.worker
    assert worker in h.engine.flights.in_flight
    await h.engine.pool.retire(h.engine.pool.models["m"])
    assert worker not in h.engine.flights.in_flight
    await h.close()


async def test_a_replacement_that_residency_stops_mid_start_leaves_the_queued_job_to_the_next_load(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Residency stopped the model's workers (an unload, a level-2 sleep: ``retire``) while the replacement still
    started; its stop counted as a failed try and failed the job queued for the model, which should have waited
    for the model's next load (a job, a wake)."""
    h = Harness()
    await h.engine.start()
    plain = FakeWorker.start

    async def start(self: FakeWorker, timeout: float) -> Ready:
        if self is h.spawned[1]:  # the replacement: still starting when residency stops it
            await until(lambda: self.asked_to_stop, what="residency to stop the replacement")
            raise WorkerStartError(f"{self.name} was stopped while it started")
        return await plain(self, timeout)

    monkeypatch.setattr(FakeWorker, "start", start)
    model = h.engine.pool.models["m"]
    h.worker.die()
    job = h.submit(timeout_s=60)  # admitted: the worker is on its way back
    await until(lambda: len(h.spawned) == 2, what="the replacement's start")
    await h.engine.pool.retire(model)
    await until(lambda: model.replacing == 0, what="the replacement's start to end")
    await h.settle()
    assert job.status == JobStatus.QUEUED, job.error
    assert "m" not in h.engine.keeper.failed and model.retired
    await h.close()


async def test_giving_up_on_one_devices_replacement_leaves_the_model_serving_on_the_other() -> None:
    """With a worker of the model still up on another device, giving up marked the model failed: its queued jobs
    failed, and residency sent nothing more to the live worker."""
    h = Harness(models=(ModelConfig(name="m", spec="fake", devices=("cpu", "cpu")),),
                fail_starts=[None, None] + [NO_CUDA] * REPLACE_ATTEMPTS)
    await h.engine.start()
    model = h.engine.pool.models["m"]
    live = h.spawned[1]
    h.spawned[0].die()
    await until(lambda: model.replacing == 0, what="the pool to stop trying")
    assert len(h.spawned) == 2 + REPLACE_ATTEMPTS
    assert "m" not in h.engine.keeper.failed
    job = h.submit()
    await until(lambda: bool(live.executed), what="the job to reach the live worker")
    live.finish(live.executed[0])
    await h.settle(job)
    assert job.status == JobStatus.SUCCEEDED, job.error
    await h.close()
