"""Turns between models on one device (daemon/residency/turns.py): the model there keeps serving its queue,
and a job of another waits behind it no longer than ``--max-model-wait``.

Three layers: the pure rules step by step, with the time passed in (every transition: a hold begins, its
model leaves, the turn begins and is kept for the bound, holds end for each reason); the engine with fake
workers, where a steady stream for one model and a job for another run through the real keeper and
scheduler; and the option as flags and TOML give it. The same against a real daemon is in
test_residency_daemon.py."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import pytest
from enginekit import CAPS, FakeWorker, Harness

from diffusiond.daemon.config import ConfigError, ModelConfig, build_config
from diffusiond.daemon.core.jobs import Job, JobRequest
from diffusiond.daemon.residency.decisions import Evict, Wait
from diffusiond.daemon.residency.policy import Residency
from diffusiond.daemon.residency.turns import Standing, Turns
from diffusiond.daemon.residency.working import Shape
from diffusiond.ipc.messages import Execute, Ready
from diffusiond.protocol import Event, JobStatus, WorkerState

B = 30.0  # the bound of these tests, in seconds
G = 1 << 30


def st(name: str, tier: str = "device", *, device: str = "cuda:0", pinned: bool = False, moving: bool = False,
       running: bool = False, oldest: float | None = None, blocked: bool = False) -> Standing:
    return Standing(name, device, tier, pinned, moving, running, oldest, blocked)  # type: ignore[arg-type]


def a_serving(running: bool = True, oldest: float | None = 0.0) -> Standing:
    """``a`` on the device with a steady stream: a batch running and more queued."""
    return st("a", running=running, oldest=oldest)


def b_waiting(since: float = 0.0, **kw: Any) -> Standing:
    """``b`` off the device with a job queued since ``since``, told by residency to wait for memory."""
    return st("b", kw.pop("tier", "host"), oldest=since, blocked=kw.pop("blocked", True), **kw)


# ---- the rules, step by step ----------------------------------------------------------------------------

def test_the_model_on_the_device_keeps_it_until_a_job_of_another_has_waited_past_the_bound() -> None:
    t = Turns(B)
    assert t.review([a_serving(), b_waiting()], now=B) == ([], []), "at the bound itself: not longer than it"
    assert t.held("a") is None
    begun, ended = t.review([a_serving(), b_waiting()], now=B + 0.5)
    assert ended == [] and [(h.model, h.for_model, h.device) for h in begun] == [("a", "b", "cuda:0")]
    assert t.held("a") == begun[0]
    assert "a job of b has waited 30.5 s for cuda:0, longer than --max-model-wait 30 s" in begun[0].reason
    assert "a takes no new batch" in begun[0].reason
    assert t.review([a_serving(), b_waiting()], now=B + 1) == ([], []), "held once, not again at each dispatch"


def test_a_hold_ends_when_the_model_it_yields_to_runs_and_that_turn_is_kept_for_the_bound() -> None:
    t = Turns(B)
    t.review([a_serving(), b_waiting()], now=B + 1)
    # a's batches finish and it leaves: the hold stays while b loads, so a cannot take the room back first
    assert t.review([a_serving(running=False), b_waiting()], now=B + 2) == ([], [])
    assert t.review([st("a", "host", oldest=B), b_waiting(moving=True, tier="loading")], now=B + 3) == ([], [])
    assert t.held("a") is not None
    # b runs: its turn has begun
    begun, ended = t.review([st("a", "host", oldest=B, blocked=True), st("b", running=True, oldest=B + 3)],
                            now=B + 4)
    assert begun == [] and [(e.hold.model, e.reason) for e in ended] == [("a", "b runs on cuda:0: its turn has begun")]
    assert t.held("a") is None and t.turns == {"b": B + 4}
    # a's job has waited past the bound long since, but b's turn lasts the bound: no swap at every batch
    a_off = st("a", "host", oldest=B, blocked=True)
    for now in (B + 5, 2 * B + 3.9):
        assert t.review([a_off, st("b", running=True, oldest=now)], now=now) == ([], [])
    begun, _ = t.review([a_off, st("b", running=True, oldest=2 * B + 4)], now=2 * B + 4)
    assert [(h.model, h.for_model) for h in begun] == [("b", "a")], "then b yields to a in turn"


@pytest.mark.parametrize(("b", "why"), [
    (b_waiting(blocked=False), "residency did not say it waits for memory: it loads or is let in by itself"),
    (b_waiting(moving=True, tier="loading"), "it is on its way in already"),
    (b_waiting(running=True, tier="device"), "it runs: it is not kept out"),
    (st("b", "host"), "nothing queued"),
])
def test_no_hold_for_a_model_that_is_not_kept_out(b: Standing, why: str) -> None:
    t = Turns(B)
    assert t.review([a_serving(), b], now=10 * B) == ([], []), why


@pytest.mark.parametrize(("a", "why"), [
    (st("a", pinned=True, running=True, oldest=0.0), "pinned: never leaves its device for another model"),
    (st("a"), "idle: the policy sends it away by itself"),
    (st("a", "host", oldest=0.0), "not on the device"),
    (st("a", moving=True, running=True), "leaving already"),
    (st("a", device="cuda:1", running=True, oldest=0.0), "on another device"),
])
def test_only_a_busy_unpinned_model_on_the_same_device_is_held(a: Standing, why: str) -> None:
    t = Turns(B)
    assert t.review([a, b_waiting()], now=10 * B) == ([], []), why


def test_a_hold_ends_when_its_model_has_nothing_left_waiting_or_is_gone() -> None:
    t = Turns(B)
    t.review([a_serving(), b_waiting()], now=B + 1)
    _, ended = t.review([a_serving(), st("b", "host")], now=B + 2)  # b's job was cancelled
    assert [e.reason for e in ended] == ["b has no job waiting any more"] and t.turns == {}
    t.review([a_serving(), b_waiting()], now=B + 3)
    _, ended = t.review([a_serving()], now=B + 4)
    assert [e.reason for e in ended] == ["b is no longer served"]


def test_the_blocker_whose_own_jobs_waited_least_is_held_and_one_at_a_time() -> None:
    t = Turns(B)
    # a budget for two: a and c on the device, both busy; b kept out
    a, c = st("a", running=True, oldest=5.0), st("c", running=True, oldest=20.0)
    begun, _ = t.review([a, b_waiting(), c], now=B + 1)
    assert [h.model for h in begun] == ["c"], "c's jobs waited 11 s, a's 26 s"
    # c finished its batch and is still on the device (on its way out): a is not held as well
    assert t.review([a, b_waiting(), st("c", oldest=20.0)], now=B + 2) == ([], [])
    # c has left, and b still cannot get in (it needs more than c held): a yields too
    begun, _ = t.review([a, b_waiting(), st("c", "host", oldest=20.0)], now=B + 3)
    assert [(h.model, h.for_model) for h in begun] == [("a", "b")]


def test_the_longest_waiting_model_goes_first_and_a_held_model_owes_no_turn() -> None:
    t = Turns(B)
    models = [a_serving(), b_waiting(since=3.0), st("c", "host", oldest=1.0, blocked=True)]
    begun, _ = t.review(models, now=B + 4)
    assert [(h.model, h.for_model) for h in begun] == [("a", "c")], "c has waited longer; b has no one left to hold"
    # while c is owed its turn, it holds no one either, whatever b's wait
    models = [st("a", "host", oldest=0.0, blocked=True), b_waiting(since=3.0), st("c", "loading", moving=True,
                                                                                  oldest=1.0)]
    assert t.review(models, now=B + 5) == ([], [])


def test_a_failed_move_releases_the_hold_and_it_is_not_tried_again_for_the_bound() -> None:
    t = Turns(B)
    t.review([a_serving(), b_waiting()], now=B + 1)
    ended = t.release("a", "its move off device failed", now=B + 2)
    assert ended is not None and ended.reason == "its move off device failed" and t.held("a") is None
    assert t.release("a", "again", now=B + 2) is None
    assert t.review([a_serving(), b_waiting()], now=B + 3) == ([], [])
    begun, _ = t.review([a_serving(), b_waiting()], now=2 * B + 2)
    assert [h.model for h in begun] == ["a"]


def test_a_failed_load_releases_those_that_yield_to_it() -> None:
    t = Turns(B)
    t.review([a_serving(), b_waiting()], now=B + 1)
    ended = t.release_for("b", "b failed to load")
    assert [(e.hold.model, e.reason) for e in ended] == [("a", "b failed to load")] and t.holds == {}
    assert t.release_for("b", "again") == []


def test_no_bound_never_holds_and_zero_lets_a_waiting_model_in_at_once() -> None:
    never = Turns(math.inf)
    assert never.review([a_serving(), b_waiting()], now=1e9) == ([], [])
    assert never.next_check([a_serving(), b_waiting()], now=0.0) is None
    at_once = Turns(0.0)
    begun, _ = at_once.review([a_serving(), b_waiting(since=1.0)], now=1.001)
    assert [h.model for h in begun] == ["a"]
    with pytest.raises(ValueError, match="must not be negative"):
        Turns(-1.0)
    with pytest.raises(ValueError, match="must not be negative"):
        Turns(math.nan)


def test_next_check_is_when_a_kept_out_job_passes_the_bound_or_a_turn_ends() -> None:
    t = Turns(B)
    assert t.next_check([a_serving(), st("b", "host", oldest=4.0)], now=5.0) is None, "b is not kept out"
    assert t.next_check([a_serving(), b_waiting(since=4.0)], now=5.0) == 4.0 + B
    t.turns["a"] = 10.0
    assert t.next_check([a_serving(), b_waiting(since=4.0)], now=B + 5) == 10.0 + B, "b is due; a's turn ends later"
    assert t.next_check([a_serving(), b_waiting(since=4.0)], now=B + 11) is None


def test_the_policy_sends_a_held_model_away_with_its_jobs_queued_but_never_while_it_runs() -> None:
    r = Residency({"cuda:0": 6 * G}, 16 * G)
    r.add("a", "cuda:0", 4 * G)
    r.loading_started("a")
    r.loaded("a", 0.0)
    r.queue("a", 2)
    assert isinstance(r.evict("a", "by hand"), Wait), "by hand: not while it has work"
    got = r.evict("a", "it yields cuda:0 to b (--max-model-wait)", queued_ok=True)
    assert isinstance(got, Evict) and [(m.model, m.src, m.dst) for m in got.moves] == [("a", "device", "host")]
    r.start("a", Shape(64, 64), 1.0)
    assert isinstance(r.evict("a", "turn", queued_ok=True), Wait), "its running batch finishes first"


# ---- the engine, with fake workers -----------------------------------------------------------------------


async def harness(monkeypatch: pytest.MonkeyPatch, a: int, b: int) -> Harness:
    """Models ``a`` and ``b`` of these many bytes on one CPU device with a 6 GiB budget, one output per batch,
    a bound of 0.2 s (a model leaving a CPU device goes to disk: its fake worker stops, and a job starts a
    new one). Working memory is the default estimate: a quarter of the weights, plus a little at 64x64."""
    weights = {"a": a, "b": b}

    async def start(self: FakeWorker, timeout: float) -> Ready:
        await asyncio.sleep(0)
        self.state = WorkerState.READY
        caps = msgspec.structs.replace(CAPS, weight_bytes=weights[self.config.model_name])
        return Ready(self.config.model_name, "cpu", 1.0, caps)

    monkeypatch.setattr(FakeWorker, "start", start)
    h = Harness(models=(ModelConfig(name="a", spec="fake"), ModelConfig(name="b", spec="fake")),
                device_memory="6GiB", max_batch=1, max_model_wait="0.2s")
    await h.engine.start()
    return h


@pytest.fixture
async def two(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Harness]:
    """4 GiB each: the budget holds one."""
    h = await harness(monkeypatch, 4 * G, 4 * G)
    yield h
    await h.close()


@pytest.fixture
async def side_by_side(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Harness]:
    """2 and 2.8 GiB: both stay on the device, with 1.2 GiB left for working memory: a's two batches in flight
    take 0.5 GiB each, b's needs 0.7 GiB, so b fits only once both of a's have ended."""
    h = await harness(monkeypatch, 2 * G, int(2.8 * G))
    yield h
    await h.close()


def worker(h: Harness, model: str) -> FakeWorker:
    return [w for w in h.spawned if w.config.model_name == model][-1]


def submit(h: Harness, model: str) -> Job:
    return h.engine.submit(JobRequest(model=model, prompt="x", n=1, width=64, height=64, steps=2, guidance=1.0,
                                      output_format="png", seed=1))


async def run_next(h: Harness, model: str, done: int) -> Execute:
    """Let ``model``'s worker finish its batch number ``done`` (counting from 0) and return it."""
    for _ in range(200):
        w = worker(h, model)
        if w.state == WorkerState.READY and len(w.executed) > done:
            batch = w.executed[done]
            w.finish(batch)
            await h.settle()
            return batch
        await asyncio.sleep(0.01)
    raise AssertionError(f"{model} ran no batch {done}: {[(x.config.model_name, x.state) for x in h.spawned]}")


async def test_a_job_of_the_model_off_the_device_runs_while_the_other_keeps_a_steady_stream(two: Harness) -> None:
    h = two
    assert worker(h, "b").state == WorkerState.DEAD, "the budget holds one: b left at start"
    a_jobs = [submit(h, "a") for _ in range(3)]
    b_job = submit(h, "b")
    stages: list[str] = []  # what a's later jobs say while they wait
    await steady_a_until_b_runs(h, a_jobs, b_job, on_submit=lambda job: job.listeners.add(
        lambda e, j: stages.append(j.stage_label) if e == Event.STATUS else None))
    assert b_job.status == JobStatus.SUCCEEDED, f"b's job is {b_job.stage_label}"
    waiting = [j for j in a_jobs if not j.terminal]
    assert waiting, "b ran before a's queue drained"
    assert "waiting_for_turn" in stages, stages
    assert h.engine.keeper.turns.held("a") is None, "b ran: a's hold ended"
    assert h.engine.metrics.registry.get_sample_value(
        "diffusiond_model_evictions_total", {"model": "a", "reason": "max_model_wait"}) == 1
    # b has nothing left: it leaves by itself, a comes back and serves what waited
    done = 0
    for _ in range(500):
        if all(j.terminal for j in waiting):
            break
        if worker(h, "a").state == WorkerState.READY and len(worker(h, "a").executed) > done:
            await run_next(h, "a", done)
            done += 1
        await asyncio.sleep(0.01)
    assert all(j.status == JobStatus.SUCCEEDED for j in waiting)


async def steady_a_until_b_runs(h: Harness, a_jobs: list[Job], b_job: Job,
                                on_submit: Callable[[Job], object] = lambda job: None) -> None:
    """Run a's batches, a new job of a for each one that ends (handed to ``on_submit``), until b's job has
    run (at most 500 rounds)."""
    ran, b_ran = 0, False
    for _ in range(500):
        if b_job.terminal:
            return
        a = worker(h, "a")
        if a.state == WorkerState.READY and len(a.executed) > ran:
            await run_next(h, "a", ran)
            ran += 1
            a_jobs.append(submit(h, "a"))
            on_submit(a_jobs[-1])
        elif worker(h, "b").state == WorkerState.READY and worker(h, "b").executed and not b_ran:
            b_ran = True
            await run_next(h, "b", 0)
        await asyncio.sleep(0.02)
    raise AssertionError(f"b's job is {b_job.stage_label} after {ran} batches of a")


async def test_a_model_that_lacked_only_working_memory_runs_beside_the_held_one_without_a_move(
        side_by_side: Harness) -> None:
    h = side_by_side
    assert [w.state for w in h.spawned] == [WorkerState.READY, WorkerState.READY], "both fit"
    a_jobs = [submit(h, "a") for _ in range(3)]
    b_job = submit(h, "b")
    assert b_job.stage_label == "waiting_for_memory", "a's batches in flight hold the working memory"
    await steady_a_until_b_runs(h, a_jobs, b_job)
    assert b_job.status == JobStatus.SUCCEEDED and any(not j.terminal for j in a_jobs)
    assert len(h.spawned) == 2 and all(w.state == WorkerState.READY for w in h.spawned), "no model moved"
    assert h.engine.metrics.registry.get_sample_value(
        "diffusiond_model_evictions_total", {"model": "a", "reason": "max_model_wait"}) is None


async def test_the_last_batch_of_the_model_on_the_device_lets_the_waiting_one_in_without_a_new_job(
        two: Harness) -> None:
    h = two
    h.engine.keeper.turns = Turns(math.inf)  # no bound: only the queue draining lets b in
    a_job, b_job = submit(h, "a"), submit(h, "b")
    assert b_job.stage_label == "waiting_for_memory"
    await run_next(h, "a", 0)
    await h.settle(a_job)
    await run_next(h, "b", 0)
    await h.settle(b_job)
    assert b_job.status == JobStatus.SUCCEEDED


# ---- the option --------------------------------------------------------------------------------------------

def test_max_model_wait_reads_as_durations_do_and_a_bad_one_stops_the_start() -> None:
    assert build_config({}, {}).max_model_wait_s == 30.0
    assert build_config({"max_model_wait": 5}, {}).max_model_wait_s == 5.0
    assert build_config({"max_model_wait": "2m"}, {"max_model_wait": "1m30s"}).max_model_wait_s == 90.0
    assert build_config({}, {"max_model_wait": "-1"}).max_model_wait_s == math.inf
    with pytest.raises(ConfigError, match=r"max_model_wait 'soon' is not a duration: give seconds \(30\)"):
        build_config({}, {"max_model_wait": "soon"})


def test_the_serve_flag_reaches_the_config() -> None:
    from diffusiond.cli import SERVE_FIELDS, build_parser

    args = build_parser().parse_args(["serve", "--max-model-wait", "45s"])
    overrides = {k: getattr(args, k) for k in SERVE_FIELDS if getattr(args, k) is not None}  # as cli.serve
    assert build_config({}, overrides).max_model_wait_s == 45.0


async def test_jobs_admitted_before_their_model_is_known_count_as_its_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """A job sent while its model's worker still starts (or resumed from the state dir) is admitted before
    residency knows the model; once its worker is ready the job counts, so the model is not idle (and not
    sent away to make room) while that job waits."""
    release = asyncio.Event()

    async def start(self: FakeWorker, timeout: float) -> Ready:
        await release.wait()
        self.state = WorkerState.READY
        return Ready(self.config.model_name, "cpu", 1.0, msgspec.structs.replace(CAPS, weight_bytes=G))

    monkeypatch.setattr(FakeWorker, "start", start)
    h = Harness(models=(ModelConfig(name="a", spec="fake"),), device_memory="6GiB", max_batch=1)
    starting = asyncio.ensure_future(h.engine.start())
    try:
        for _ in range(100):
            if h.engine.accepting:
                break
            await asyncio.sleep(0.01)
        jobs = [submit(h, "a") for _ in range(3)]  # admitted while a is not yet known to residency
        assert not h.engine.keeper.known("a")
        release.set()
        await starting
        await h.settle()
        status = h.engine.keeper.snapshot()["a"]
        assert status.queued + status.running == 3, status  # one batch sent, two waiting: all of them its work
        assert all(j.status in (JobStatus.QUEUED, JobStatus.RUNNING) for j in jobs)
    finally:
        release.set()
        await h.close()
