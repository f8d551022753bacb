"""``/ready`` means "admitting", not "every preload finished" (issue 27).

The engine with fake workers, whose start the test holds open with a gate, so each case sees the preload
mid-way without timing: jobs admitted then wait and run once their model's READY comes (nothing else has
to happen to dispatch them); a job for a model the preload leaves on disk runs once the preload ends; and
when every model the start tried fails, what was admitted meanwhile ends with the start's reason (or,
where jobs persist, stays queued on disk for the next start), and nothing hangs. ``/ready`` and systemd's
READY=1 against a real daemon: test_durable.py (``test_jobs_are_accepted_while_the_models_load``) and
test_daemon_systemd.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import msgspec
import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request
from enginekit import CAPS, FakeWorker, Harness, hold_starts
from residencykit import G

import diffusiond.daemon.edge.api as api
import diffusiond.daemon.server as server
from diffusiond.daemon.config import ModelConfig
from diffusiond.daemon.core.jobs import Job
from diffusiond.daemon.edge.status import ENGINE
from diffusiond.daemon.errors import ModelTooLarge
from diffusiond.daemon.state.store import SqliteStore
from diffusiond.daemon.workers.link import WorkerStartError
from diffusiond.ipc.messages import Ready
from diffusiond.protocol import ErrorCode, JobStatus, WorkerState

BROKEN = "loading model 'm' failed: no such folder"


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> asyncio.Event:
    """Fake workers finish their start only once the test sets the event: the preload is held mid-way."""
    return hold_starts(monkeypatch)


async def test_a_job_admitted_while_its_model_preloads_waits_then_runs(gate: asyncio.Event) -> None:
    h = Harness()
    await h.engine.open()
    assert h.engine.accepting  # what /ready answers 200 on
    assert h.engine.keeper.preloading.view() == {"state": "running", "models": ["m"]}
    preload = asyncio.ensure_future(h.engine.preload())
    job = h.submit()
    await h.settle()
    assert job.status == JobStatus.QUEUED and not h.spawned[0].executed
    health = await api.health(make_mocked_request("GET", "/health", app=_app(h)))
    assert health.status == 200, health.text  # a model loading is not a sick daemon (a probe must not restart it)
    assert json.loads(health.text)["status"] == "ok"
    gate.set()
    await preload
    assert h.engine.keeper.preloading.view() == {"state": "done", "models": []}
    [batch] = h.worker.executed  # sent at the model's READY
    h.worker.finish(batch)
    await h.settle(job)
    assert job.status == JobStatus.SUCCEEDED
    await h.close()


async def test_a_job_for_a_model_the_preload_leaves_on_disk_runs_once_it_ends(gate: asyncio.Event) -> None:
    h = Harness(models=(ModelConfig(name="m", spec="fake"), ModelConfig(name="n", spec="fake", preload=False)))
    await h.engine.open()
    assert h.engine.keeper.preloading.view() == {"state": "running", "models": ["m"]}
    preload = asyncio.ensure_future(h.engine.preload())
    job = h.submit(model="n")
    await h.settle()
    gate.set()
    await preload
    await h.settle()
    [worker] = [w for w in h.spawned if w.config.model_name == "n"]
    await asyncio.wait_for(_executed(worker), 5)
    worker.finish(worker.executed[0])
    await h.settle(job)
    assert job.status == JobStatus.SUCCEEDED
    await h.close()


def _app(h: Harness) -> web.Application:
    app = web.Application()
    app[ENGINE] = h.engine
    return app


async def _executed(worker: FakeWorker) -> None:
    while not worker.executed:
        await asyncio.sleep(0.01)


async def _spawned(h: Harness, model: str) -> None:
    while not [w for w in h.spawned if w.config.model_name == model]:
        await asyncio.sleep(0.01)


async def test_when_every_preload_fails_the_jobs_admitted_meanwhile_end_with_the_reason(gate: asyncio.Event) -> None:
    h = Harness(fail_starts=[BROKEN])
    await h.engine.open()
    preload = asyncio.ensure_future(h.engine.preload())
    job = h.submit()
    gate.set()
    with pytest.raises(WorkerStartError, match="no such folder"):
        await preload
    assert job.status == JobStatus.FAILED and job.error is not None
    assert job.error["code"] == ErrorCode.SHUTTING_DOWN
    assert job.error["message"].startswith(f"the daemon could not start: {BROKEN}"), job.error
    assert not h.engine.accepting and h.engine.draining  # /ready: 503 "draining" until the process exits
    await h.close()


async def test_when_every_preload_fails_a_persisted_job_stays_queued_for_the_next_start(
        gate: asyncio.Event, tmp_path: Path) -> None:
    h = Harness(fail_starts=[BROKEN], store=SqliteStore(tmp_path))
    await h.engine.open()
    preload = asyncio.ensure_future(h.engine.preload())
    job = h.submit()
    await h.engine.store.add(job)  # what ``accept`` adds before the 202
    gate.set()
    with pytest.raises(WorkerStartError):
        await preload
    assert job.status == JobStatus.QUEUED  # left to the next start, as a shutdown leaves it
    await h.close()
    restarted = Harness(store=SqliteStore(tmp_path))
    gate.set()
    await restarted.engine.start()
    [batch] = restarted.worker.executed
    assert [r.request_id for r in batch.requests] == [f"{job.id}/0"]
    await restarted.close()


async def test_a_load_for_a_job_during_the_preload_plans_around_the_model_being_preloaded(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two models of 5 GiB under an 8 GiB budget: a job for ``n`` sent while ``m`` preloads must not start
    ``n``'s load beside it (two loads at once would pass the budget, and on a full card run out of memory);
    it waits, and once the preload is done ``m`` (idle) leaves and ``n`` loads and runs."""
    opened = hold_starts(monkeypatch, models=["m"], weight_bytes=5 * G)
    h = Harness(models=(ModelConfig(name="m", spec="fake", devices=("cuda:0",)),
                        ModelConfig(name="n", spec="fake", devices=("cuda:0",), preload=False)),
                device_memory="8GiB", max_batch=1)
    for model in h.engine.pool.models.values():  # sizes remembered from an earlier run, as a state dir keeps them
        model.known, model.capabilities = True, msgspec.structs.replace(CAPS, weight_bytes=5 * G)
    await h.engine.open()
    preload = asyncio.ensure_future(h.engine.preload())
    await h.settle()
    job = h.submit(model="n")
    await h.settle()
    assert not [w for w in h.spawned if w.config.model_name == "n"], "n's load started beside m's"
    opened.set()
    await preload
    await asyncio.wait_for(_spawned(h, "n"), 5)  # once m has left
    [worker] = [w for w in h.spawned if w.config.model_name == "n"]
    await asyncio.wait_for(_executed(worker), 5)
    worker.finish(worker.executed[0])
    await h.settle(job)
    assert job.status == JobStatus.SUCCEEDED
    assert h.engine.keeper.snapshot()["m"].residency in ("host", "disk")
    await h.close()


async def test_a_level_2_sleep_during_the_preload_leaves_the_model_on_disk_for_the_wake(gate: asyncio.Event) -> None:
    """A trainer started after the daemon's READY=1 sleeps at level 2 while the preload still loads: the sleep
    waits for that load, then frees it; the start does not fail, nor does the job, which runs after the wake."""
    h = Harness(models=(ModelConfig(name="m", spec="fake"), ModelConfig(name="n", spec="fake")))
    await h.engine.open()
    preload = asyncio.ensure_future(h.engine.preload())
    job = h.submit(model="n")
    await h.settle()
    sleeping = asyncio.ensure_future(h.engine.sleep(2))
    await h.settle()
    assert not sleeping.done()  # it waits for the load under way, as for any move
    gate.set()
    answer = await sleeping
    await preload  # not failed: a model the sleep stopped is not a model that could not load
    assert {n: (m["residency"], m["workers"]) for n, m in answer["models"].items()} == {
        "m": ("disk", 0), "n": ("disk", 0)}
    assert not answer["stayed"] and not h.engine.keeper.failed and h.engine.accepting
    assert job.status == JobStatus.QUEUED and job.error is None
    await h.engine.wake()
    [worker] = [w for w in h.spawned if w.config.model_name == "n" and w.state == WorkerState.READY]
    await asyncio.wait_for(_executed(worker), 5)
    worker.finish(worker.executed[0])
    await h.settle(job)
    assert job.status == JobStatus.SUCCEEDED
    await h.close()


async def test_a_level_1_sleep_during_the_preload_books_the_model_where_its_worker_is(gate: asyncio.Event) -> None:
    h = Harness(models=(ModelConfig(name="m", spec="fake", devices=("cuda:0",)),), device_memory="8GiB")
    await h.engine.open()
    preload = asyncio.ensure_future(h.engine.preload())
    await h.settle()
    sleeping = asyncio.ensure_future(h.engine.sleep(1))
    await h.settle()
    gate.set()
    answer = await sleeping
    await preload
    assert answer["models"]["m"]["residency"] == "host" and not answer["stayed"]
    status = h.engine.keeper.snapshot()["m"]
    assert (status.residency, status.device_bytes) == ("host", 0)  # not counted on the device while it sleeps
    assert [w.state for w in h.engine.pool.models["m"].workers] == [WorkerState.SLEEPING]
    await h.engine.wake()
    assert h.engine.keeper.snapshot()["m"].residency == "device"
    await h.close()


async def test_a_job_sent_during_the_preload_for_a_model_too_large_is_refused_as_after_it(
        gate: asyncio.Event) -> None:
    """``n``'s size is remembered (9 GiB, over the 8 GiB budget) and the preload has not reached it yet: the job
    is the 400 ``model_too_large`` it would be after the preload, not a job queued for a load that never comes."""
    h = Harness(models=(ModelConfig(name="m", spec="fake", devices=("cuda:0",)),
                        ModelConfig(name="n", spec="fake", devices=("cuda:0",))), device_memory="8GiB")
    sizes = {"m": G, "n": 9 * G}
    for model in h.engine.pool.models.values():
        model.known, model.capabilities = True, msgspec.structs.replace(CAPS, weight_bytes=sizes[model.name])
    await h.engine.open()
    preload = asyncio.ensure_future(h.engine.preload())
    await h.settle()
    with pytest.raises(ModelTooLarge, match="'n' cannot fit on cuda:0"):
        h.submit(model="n")
    gate.set()
    await preload
    assert h.engine.keeper.snapshot()["n"].residency == "disk"
    await h.close()


def n_held(monkeypatch: pytest.MonkeyPatch) -> asyncio.Event:
    """Model ``n``'s worker starts only once the returned event is set: a preload still under way."""
    opened = asyncio.Event()
    plain = FakeWorker.start

    async def start(self: FakeWorker, timeout: float) -> Ready:
        if self.config.model_name == "n":
            await opened.wait()
        return await plain(self, timeout)

    monkeypatch.setattr(FakeWorker, "start", start)
    return opened


async def stopped_in_preload(h: Harness) -> tuple[Job, Job, FakeWorker, float, tuple[str, ...]]:
    """A stop while ``n`` still preloads (``n_held``), with a job running on ``m`` and one queued for ``n``: the
    two jobs, ``m``'s worker, and the grace and the models left unloaded that the stop hands to the drain."""
    stop = asyncio.Event()
    serving = asyncio.ensure_future(server._serve(h.engine, stop, "a test", socket_activated=False))
    await asyncio.wait_for(_spawned(h, "n"), 5)
    running, waiting = h.submit(), h.submit(model="n")
    [worker] = [w for w in h.spawned if w.config.model_name == "m"]
    await asyncio.wait_for(_executed(worker), 5)
    stop.set()
    grace, unloaded = await serving
    return running, waiting, worker, grace, unloaded


async def test_a_stop_during_the_preload_gives_the_running_jobs_the_drain_grace(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A restart while ``n`` still preloads: ``m``'s running job has ``--drain-grace-s`` to finish (it is not
    failed at once), while the job queued for ``n``, which will not load now, ends at once."""
    n_held(monkeypatch)
    h = Harness(models=(ModelConfig(name="m", spec="fake"), ModelConfig(name="n", spec="fake")))
    running, waiting, worker, grace, unloaded = await stopped_in_preload(h)
    assert (grace, unloaded) == (h.engine.config.drain_grace_s, ("n",))
    drain = asyncio.ensure_future(h.engine.drain(grace, unloaded=unloaded))
    await h.settle()
    assert waiting.status == JobStatus.FAILED and waiting.error is not None
    assert waiting.error["code"] == ErrorCode.SHUTTING_DOWN
    assert running.status == JobStatus.RUNNING and not drain.done()
    worker.finish(worker.executed[0])
    await asyncio.wait_for(drain, 5)
    assert running.status == JobStatus.SUCCEEDED
    await h.close()


async def test_a_stop_during_the_preload_ends_with_the_running_jobs_when_the_rest_stay_on_disk(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Where jobs persist, the job queued for ``n`` is left in the state dir at once and stays queued there: the
    drain waited for it too, its whole grace after the running job had finished, and left it a second time."""
    opened = n_held(monkeypatch)
    caplog.set_level(logging.INFO, logger="diffusiond.daemon.core.resume")
    h = Harness(models=(ModelConfig(name="m", spec="fake"), ModelConfig(name="n", spec="fake")),
                drain_grace_s=600.0, store=SqliteStore(tmp_path))
    running, waiting, worker, grace, unloaded = await stopped_in_preload(h)
    drain = asyncio.ensure_future(h.engine.drain(grace, unloaded=unloaded))
    await h.settle()
    worker.finish(worker.executed[0])
    await asyncio.wait_for(drain, 5)  # not the 600 s grace
    assert running.status == JobStatus.SUCCEEDED and waiting.status == JobStatus.QUEUED
    assert caplog.text.count(f"job {waiting.id} (") == 1  # "... stays in the state dir", once
    opened.set()
    await h.close()


async def test_a_queued_job_for_a_model_its_load_shows_too_large_fails_with_the_reason(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Admitted on the 1 GiB remembered, ``m``'s load reports 9 GiB, over the 8 GiB budget: its job fails with
    ``model_too_large`` and the reason, not held queued for a run that can never come."""
    async def start(self: FakeWorker, timeout: float) -> Ready:
        self.state = WorkerState.READY
        return Ready(self.config.model_name, self.config.device, 1.0, msgspec.structs.replace(CAPS, weight_bytes=9 * G))

    monkeypatch.setattr(FakeWorker, "start", start)
    h = Harness(models=(ModelConfig(name="m", spec="fake", devices=("cuda:0",), preload=False),),
                device_memory="8GiB")
    model = h.engine.pool.models["m"]
    model.known, model.capabilities = True, msgspec.structs.replace(CAPS, weight_bytes=G)
    await h.engine.start()
    job = h.submit()
    await h.settle(job)
    assert job.status == JobStatus.FAILED and job.error is not None
    assert job.error["code"] == ErrorCode.MODEL_TOO_LARGE, job.error
    assert "'m' cannot fit on cuda:0" in job.error["message"], job.error
    await h.close()


@pytest.mark.parametrize("budget", ["8GiB", None], ids=["a budget", "no budget"])
async def test_a_job_admitted_before_the_preload_begins_waits_for_its_load_and_ready_says_it_runs(
        budget: str | None, gate: asyncio.Event) -> None:
    """A job that waited at admission for the state dir's recovery is admitted (and dispatched) as ``open`` ends,
    before the preload's first step. For a model the state dir remembers, that dispatch used to start a load of
    its own: the preload then found the model "loading", left it, and ``/ready`` said ``done`` with nothing
    loaded while the load went on (the flaky test_durable.py::test_jobs_are_accepted_while_the_models_load).
    The preload loads what it chose; the job waits in ``loading`` for that one load."""
    h = Harness(models=(ModelConfig(name="m", spec="fake", devices=("cuda:0",)),),
                **({"device_memory": budget} if budget else {}))
    model = h.engine.pool.models["m"]
    model.known, model.capabilities = True, msgspec.structs.replace(CAPS, weight_bytes=G)  # remembered
    await h.engine.open()
    job = h.submit()  # as server._serve runs: admitted between ``open`` and the preload's first step
    preload = asyncio.ensure_future(h.engine.preload())
    await h.settle()
    assert h.engine.keeper.preloading.view() == {"state": "running", "models": ["m"]}
    assert job.status == JobStatus.QUEUED and job.stage_label == "loading", job.stage_label
    assert len(h.spawned) == 1, "a second load of m beside the preload's"
    gate.set()
    await preload
    assert h.engine.keeper.preloading.view() == {"state": "done", "models": []}
    await asyncio.wait_for(_executed(h.worker), 5)
    h.worker.finish(h.worker.executed[0])
    await h.settle(job)
    assert job.status == JobStatus.SUCCEEDED and len(h.spawned) == 1
    await h.close()


async def test_a_job_that_passes_its_deadline_while_its_model_loads_says_it_was_loading(gate: asyncio.Event) -> None:
    """Shown as ``loading`` while it waited, it failed "while queued", in stage ``queued``: the reason it was held
    back was lost from its error."""
    h = Harness(models=(ModelConfig(name="m", spec="fake", devices=("cuda:0",)),), device_memory="8GiB")
    model = h.engine.pool.models["m"]
    model.known, model.capabilities = True, msgspec.structs.replace(CAPS, weight_bytes=G)
    await h.engine.open()
    job = h.submit(timeout_s=0.2)
    preload = asyncio.ensure_future(h.engine.preload())
    await h.settle(job)
    assert job.status == JobStatus.FAILED and job.error is not None
    assert job.error["stage"] == "loading", job.error
    assert "passed its deadline of 0.2s while loading" in job.error["message"], job.error
    gate.set()
    await preload
    await h.close()
