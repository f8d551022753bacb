"""One worker of a model with several dies: only its copy of the weights leaves what the model holds
(the budget keeps its room for the pool's replacement), the others serve on with their runs still
counted, and the model is on disk only once none of its workers is left.
Before, the whole model was booked as gone: the next job's plan loaded it from disk, and ``revive`` started a
full second set of workers beside the survivors and the pool's replacement (4 workers for a model of 2), whose
copies no budget counted. The room's rule, then the engine with fake workers on two fake GPUs; the real daemon
is test_residency_daemon.py's.
"""

from __future__ import annotations

import pytest
from enginekit import FakeWorker, Harness, hold_starts
from residencykit import G, S

from diffusiond.daemon.config import ModelConfig
from diffusiond.daemon.residency.decisions import Fits
from diffusiond.daemon.residency.policy import Residency
from diffusiond.protocol import JobStatus, WorkerState


def two_gpus(*devices: str) -> Residency:
    r = Residency({"cuda:0": 20 * G, "cuda:1": 20 * G}, 0)
    r.add("m", devices, 4 * G)
    r.measured("m", S, G)
    r.loading_started("m")
    r.loaded("m", now=0)
    return r


def test_a_dead_worker_frees_its_copy_only_and_the_survivor_serves_with_its_run_booked() -> None:
    r = two_gpus("cuda:0", "cuda:1")
    r.queue("m")
    r.start("m", S, now=1, device="cuda:1")
    r.worker_died("m", "cuda:0", "killed by SIGKILL")
    assert r.tier("m") == "device" and "a worker on cuda:0 died: killed by SIGKILL" in r.snapshot()[0].reason
    assert r.snapshot()[0].per_device == {"cuda:0": 0, "cuda:1": 5 * G}, "the survivor's run stays booked"
    assert r.device_used("cuda:0") == 4 * G, "the room its replacement will take back stays booked"
    r.queue("m")
    plan = r.plan("m", S)
    assert isinstance(plan, Fits) and plan.load_from is None, "no load from disk beside the survivor"
    r.finish("m", S, now=2, device="cuda:1")  # before: a ResidencyError, the run having left the books
    assert r.device_used("cuda:1") == 4 * G
    r.worker_back("m", "cuda:0")  # its replacement's READY
    assert (r.device_used("cuda:0"), r.device_used("cuda:1")) == (4 * G, 4 * G)
    r.worker_back("m", "cuda:0")  # a READY that replaces nobody counts nothing twice
    assert r.device_used("cuda:0") == 4 * G
    r.worker_died("m", "cuda:1", "exit code 1")
    r.worker_died("m", "cuda:0", "exit code 1")  # the last one: the model is on disk, nothing counted
    assert r.tier("m") == "disk" and r.device_used("cuda:0") == r.device_used("cuda:1") == 0


def test_two_workers_on_one_device_lose_one_copy_and_the_dead_ones_run_ends_as_the_engine_reports_it() -> None:
    r = two_gpus("cuda:0", "cuda:0")
    assert r.device_used("cuda:0") == 8 * G
    r.queue("m", 2)
    r.start("m", S, now=1, device="cuda:0")
    r.start("m", S, now=1, device="cuda:0")
    r.worker_died("m", "cuda:0", "killed")
    held = lambda: r.snapshot()[0].per_device["cuda:0"]  # noqa: E731 - what it holds; the budget counts the copy
    assert held() == 4 * G + 2 * G, "which run was the dead worker's is the engine's to say"
    r.finish("m", S, now=2, device="cuda:0")  # the engine fails the dead worker's batch (flights.lost)
    assert held() == 5 * G and r.snapshot()[0].running == 1
    r.finish("m", S, now=3, device="cuda:0")
    assert held() == 4 * G and r.device_used("cuda:0") == 8 * G, "its replacement's room stays booked"


def test_a_dead_workers_kept_host_copy_leaves_and_the_others_stay() -> None:
    r = Residency({"cuda:0": 20 * G, "cuda:1": 20 * G}, 40 * G)
    r.add("m", ("cuda:0", "cuda:1"), 4 * G)
    r.loading_started("m")
    r.loaded("m", now=0)
    r.keeps("m", 8 * G)  # each worker's copy, as they answered a WAKE
    r.worker_died("m", "cuda:1", "killed", kept=4 * G)
    assert r.kept("m") == 4 * G and r.host_used() == 4 * G


@pytest.fixture
def weighs_a_gib(monkeypatch: pytest.MonkeyPatch) -> object:
    opened = hold_starts(monkeypatch, weight_bytes=G)
    opened.set()
    return opened


async def test_a_job_after_one_of_two_workers_died_runs_on_the_survivor_and_no_second_set_starts(
        weighs_a_gib: object) -> None:
    """The reviewer's repro, with fake workers: kill one of two, send a job at once. Before, the job's plan said
    "load from disk" and ``revive`` started two workers beside the survivor and the replacement."""
    opened = weighs_a_gib
    h = Harness(models=(ModelConfig(name="m", spec="fake", devices=("cuda:0", "cuda:1")),),
                device_memory="8GiB", host_memory="0", max_batch=1)
    await h.engine.start()
    try:
        keeper = h.engine.keeper
        w0, w1 = h.spawned
        running = h.submit()
        await h.settle()
        (busy,) = [w for w in (w0, w1) if w.executed]
        other = w1 if busy is w0 else w0
        opened.clear()  # type: ignore[attr-defined]  # the replacement's start waits: the books in between
        other.die()
        await h.settle()
        status = keeper.snapshot()["m"]
        assert status.residency == "device", status
        assert status.per_device[other.config.device] == 0, "the dead worker's copy left the books"
        assert status.per_device[busy.config.device] > G, "the survivor's copy and running batch stay booked"
        job = h.submit()
        await h.settle()
        assert len(h.spawned) == 3, [w.config.device for w in h.spawned]  # the replacement only
        busy.finish(busy.executed[0])
        await h.settle(running)
        assert running.status == JobStatus.SUCCEEDED
        await h.settle()
        assert len(busy.executed) == 2, "the job ran on the survivor, not held for a load"
        busy.finish(busy.executed[1])
        await h.settle(job)
        assert job.status == JobStatus.SUCCEEDED
        assert keeper.policy.device_used(busy.config.device) == G
        opened.set()  # type: ignore[attr-defined]
        await h.settle()
        live = [w for w in h.engine.pool.models["m"].workers if w.state != WorkerState.DEAD]
        assert sorted(w.config.device for w in live) == ["cuda:0", "cuda:1"] and len(h.spawned) == 3
        status = keeper.snapshot()["m"]
        assert status.per_device == {"cuda:0": G, "cuda:1": G}, "the replacement's copy is counted again"
    finally:
        await h.close()


async def test_a_load_by_hand_of_a_model_with_a_survivor_starts_workers_only_where_none_is(
        weighs_a_gib: object) -> None:
    """``revive`` starts a worker for each device that has none, not one per device configured."""
    h = Harness(models=(ModelConfig(name="m", spec="fake", devices=("cuda:0", "cuda:1")),),
                device_memory="8GiB", host_memory="0", max_batch=1)
    await h.engine.start()
    try:
        model = h.engine.pool.models["m"]
        await h.engine.pool.revive(model)
        assert len(h.spawned) == 2 and not model.retired
        model.workers.remove(h.spawned[0])  # as the pool gives up a lost worker (``_give_up``)
        await h.engine.pool.revive(model)
        assert [w.config.device for w in h.spawned] == ["cuda:0", "cuda:1", "cuda:0"]
        assert isinstance(h.spawned[-1], FakeWorker) and h.spawned[-1].state == WorkerState.READY
    finally:
        await h.close()


async def test_a_lost_worker_is_not_replaced_once_its_models_workers_were_stopped(weighs_a_gib: object) -> None:
    """The model stays on its device after one worker's death, so a keep-alive may take it to disk (``retire``)
    before the replacement's back-off ends: that replacement would be a lone worker of a model on disk, booked as
    both when its READY came, and the next load would start the whole set beside it."""
    h = Harness(models=(ModelConfig(name="m", spec="fake", devices=("cuda:0", "cuda:1")),),
                device_memory="8GiB", host_memory="0", max_batch=1)
    await h.engine.start()
    try:
        model = h.engine.pool.models["m"]
        h.spawned[0].die()
        await h.engine.pool.retire(model)  # as a move to disk does, its replacement not started yet
        await h.settle()
        assert len(h.spawned) == 2 and model.workers == [] and model.retired and model.replacing == 0
        await h.engine.pool.revive(model)
        assert [w.config.device for w in model.workers] == ["cuda:0", "cuda:1"]
    finally:
        await h.close()
