"""The residency room's transitions, against the fake engine of residencykit.py: loading and
a failed load, a worker dying mid-load, models on their way out and moves that fail, a CPU device,
preload, a standstill, a share of the device, reports that contradict the state, and random request
streams (hypothesis) that never exceed the budget nor evict busy or pinned models. The rules for fit,
eviction, keep-alive, pressure and out-of-memory are test_residency.py's."""

from __future__ import annotations

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from residencykit import Engine, G, S, on_device, room, tier

from diffusiond.daemon.residency import decisions as dec
from diffusiond.daemon.residency.decisions import Evict, Fits, Move, Release, TooLarge, Wait
from diffusiond.daemon.residency.policy import Residency, ResidencyError
from diffusiond.daemon.residency.units import FOREVER
from diffusiond.daemon.residency.working import Shape


def test_loading_transitions_and_the_stage_a_job_waits_in() -> None:
    r = room(host=8 * G)
    r.queue("a")
    d = r.plan("a", S)
    assert isinstance(d, Fits) and d.load_from == "disk"
    r.loading_started("a")
    snap = next(s for s in r.snapshot() if s.name == "a")
    assert (snap.residency, snap.device_bytes, snap.queued) == ("loading", 4 * G, 1)
    w = r.plan("a", S)
    assert isinstance(w, Wait) and w.stage == dec.LOADING
    assert isinstance(r.plan("b", S), Wait)  # a's weights are counted while it loads
    r.load_failed("a", "unet/diffusion_pytorch_model.safetensors: truncated")
    snap = next(s for s in r.snapshot() if s.name == "a")
    assert snap.residency == "disk" and "load failed: unet/" in snap.reason and r.device_used("cuda:0") == 0
    r.loading_started("a")
    r.loaded("a", now=5)
    r.start("a", S, now=5)
    snap = next(s for s in r.snapshot() if s.name == "a")
    assert (snap.residency, snap.device_bytes, snap.running, snap.queued) == ("device", 5 * G, 1, 0)
    assert set(snap.to_dict()) >= {"residency", "device_bytes", "host_bytes", "keep_alive_until", "pinned",
                                   "queued", "running"}


def test_a_worker_that_dies_mid_load_returns_its_models_to_disk_with_the_reason() -> None:
    r = room(budget=20 * G, host=20 * G)
    e = Engine(r)
    e.run("b")
    r.queue("a")
    r.queue("b")
    r.start("b", S, e.now)
    r.loading_started("a")
    for name in "ab":  # one worker held both (as the test's room has it): each is left with none
        r.worker_died(name, "cuda:0", "exit code -9 (SIGKILL)")
    snaps = {s.name: s for s in r.snapshot()}
    assert snaps["a"].residency == "disk" and snaps["a"].reason == "worker died during its load: exit code -9 (SIGKILL)"
    assert snaps["b"].residency == "disk" and snaps["b"].running == 0
    assert snaps["a"].queued == 1  # its job waits for the next worker
    assert r.device_used("cuda:0") == 0
    d = r.plan("a", S)
    assert isinstance(d, Fits) and d.load_from == "disk"


def test_a_model_on_its_way_out_is_still_counted() -> None:
    r = room()
    e = Engine(r)
    e.run("a")
    (mv,) = r.evict("a", "unloaded by request").moves  # type: ignore[union-attr]
    r.unloading(mv)
    assert isinstance(r.plan("a", S), Wait)
    d = r.plan("b", S)
    assert isinstance(d, Wait) and "leaving" in d.reason
    r.unloaded(mv)
    assert isinstance(r.plan("b", S), Fits)


def test_a_failed_move_leaves_the_model_where_it_was() -> None:
    r = room()
    e = Engine(r)
    e.run("a")
    (mv,) = r.evict("a", "by hand").moves  # type: ignore[union-attr]
    r.unloading(mv)
    r.unload_failed(mv, "worker busy")
    assert tier(r, "a") == "device" and "failed: worker busy" in next(s.reason for s in r.snapshot())


def test_a_cpu_device_has_no_host_tier() -> None:
    r = Residency({"cpu": 6 * G}, 100 * G)
    for name in "ab":
        r.add(name, "cpu", 4 * G)
        r.measured(name, S, G)
    e = Engine(r)
    e.run("a")
    e.run("b")
    assert [(mv.model, mv.dst) for mv in e.moves] == [("a", "disk")]


def test_preload_takes_what_fits_in_the_order_configured() -> None:
    r = room(budget=9 * G, models={"a": 4 * G, "big": 8 * G, "b": 4 * G, "c": 4 * G})
    assert r.preload(["a", "big", "b", "c"]) == ["a", "b"]


def test_a_standstill_of_queued_models_that_cannot_start_is_broken() -> None:
    r = room(budget=10 * G, working=3 * G)  # two fit as weights, not with a run beside them
    e = Engine(r)
    for name in "ab":
        e.admit(name, shape=None)  # type: ignore[arg-type]
    assert sorted(on_device(r)) == ["a", "b"]
    r.queue("a")
    r.queue("b")
    d = r.plan("a", S)
    assert isinstance(d, Evict) and [mv.model for mv in d.moves] == ["b"] and "standstill" in d.reason


def test_reports_that_contradict_the_state_are_refused() -> None:
    r = room()
    with pytest.raises(ResidencyError, match="not on cuda:0"):
        r.start("a", S, 0)
    with pytest.raises(ResidencyError, match="not loading"):
        r.loaded("a", 0)
    with pytest.raises(ResidencyError, match="only 0 are queued"):
        r.unqueue("a")
    with pytest.raises(ResidencyError, match="had not started"):
        r.unloaded(Move("a", "device", "host", "x"))
    with pytest.raises(ResidencyError, match="not known"):
        r.plan("nope", S)
    Engine(r).run("a")
    with pytest.raises(ResidencyError, match="not running"):
        r.finish("a", S, 0)
    with pytest.raises(ValueError, match="already known"):
        r.add("a", "cuda:0", 1)
    with pytest.raises(ValueError, match="has no budget"):
        r.add("z", "cuda:7", 1)


# ---- random streams ------------------------------------------------------------------------------------

request = st.tuples(st.just("request"), st.sampled_from("abcd"),
                    st.sampled_from([S, Shape(128, 128, 2), Shape(32, 32)]), st.sampled_from([None, 0.0, 5.0, FOREVER]))
ops = st.lists(st.one_of(
    request, request, request,
    st.tuples(st.just("finish"), st.integers(0, 7)),
    st.tuples(st.just("tick"), st.floats(0, 20)),
    st.tuples(st.just("pressure"), st.integers(0, 12), st.integers(0, 4)),
    st.tuples(st.just("measure"), st.sampled_from("abcd"), st.integers(0, 4)),
    st.tuples(st.just("complete")),
), min_size=5, max_size=60)


@settings(max_examples=200, deadline=None)
@given(ops, st.booleans(), st.integers(0, 9), st.booleans(), st.booleans())
def test_random_streams_never_exceed_the_budget_nor_evict_busy_or_pinned_models(
        steps: list[tuple[object, ...]], pin: bool, host: int, slow_moves: bool, keeps: bool) -> None:
    """With ``slow_moves``, each move off a device finishes only at a later step (a worker copying), so
    plans made meanwhile see models on their way out. With ``keeps``, a model woken from host memory keeps its
    copy there, as a worker on a GPU does (issue 27), and frees it when another model needs the room."""
    r = Residency({"cuda:0": 9 * G}, host * G, keep_alive_s=10)
    for name, wb in zip("abcd", (4, 3, 5, 2), strict=True):
        r.add(name, "cuda:0", wb * G, pinned=pin and name == "d")
    e = Engine(r)
    waiting: list[tuple[str, Shape, float | None]] = []
    runs: list[tuple[str, Shape, float | None]] = []
    pending: list[Move] = []

    def move(moves: tuple[Move, ...]) -> None:
        snaps = {s.name: s for s in r.snapshot()}
        running_on = any(s.running for s in snaps.values())
        for mv in moves:
            s = snaps[mv.model]
            if isinstance(mv, Release):  # it stays and may run; an unpin and a free, done at once as a drop is
                assert keeps and s.residency == "device", mv
                event("Release")
                r.unloading(mv)
                r.unloaded(mv)
                e.check()
                continue
            assert s.running == 0 and not s.pinned, mv
            assert s.queued == 0 or not running_on, mv  # queued models leave only to break a standstill
            r.unloading(mv)
            if slow_moves and mv.src == "device":  # a copy; a drop from host memory only frees buffers
                pending.append(mv)
            else:
                r.unloaded(mv)
            e.check()

    def complete() -> None:
        while pending:
            r.unloaded(pending.pop(0))
            e.check()

    def pump() -> None:
        for _ in range(50):
            for i, (name, shape, _) in enumerate(waiting):
                d = r.plan(name, shape)
                event(type(d).__name__)
                if isinstance(d, Evict):
                    move(d.moves)
                    break
                if isinstance(d, TooLarge):
                    r.unqueue(name)
                    del waiting[i]
                    break
                if isinstance(d, Fits):
                    if d.load_from:
                        r.loading_started(name)
                        e.check()
                        r.loaded(name, e.now)
                        if keeps and d.load_from == "host":
                            r.keeps(name, {"a": 4, "b": 3, "c": 5, "d": 2}[name] * G)
                            event("kept")
                            e.check()
                    r.start(name, shape, e.now)
                    e.check()
                    runs.append(waiting.pop(i))
                    break
            else:
                return

    for step in steps:
        if step[0] == "request":
            _, name, shape, keep = step
            r.queue(name)  # type: ignore[arg-type]
            waiting.append((name, shape, keep))  # type: ignore[arg-type]
        elif step[0] == "finish" and runs:
            name, shape, keep = runs.pop(int(step[1]) % len(runs))  # type: ignore[call-overload]
            r.finish(name, shape, e.now, keep_alive_s=keep)
        elif step[0] == "tick":
            e.now += float(step[1])  # type: ignore[arg-type]
            move(r.expired(e.now))
        elif step[0] == "pressure":
            move(r.pressure("cuda:0", int(step[1]) * G, int(step[2]) * G).moves)  # type: ignore[call-overload]
        elif step[0] == "complete":
            complete()
        elif step[0] == "measure":
            r.measured(str(step[1]), S, int(step[2]) * G)  # type: ignore[call-overload]
        e.check()
        pump()
    # every job that was admitted runs in the end, once other programs give the memory back
    r.pressure("cuda:0", 100 * G, 0)
    for _ in range(100):
        complete()
        pump()
        if runs:
            name, shape, keep = runs.pop(0)
            r.finish(name, shape, e.now, keep_alive_s=keep)
        elif not pending:
            break
    assert waiting == []
    assert all(s.queued == 0 and s.running == 0 for s in r.snapshot())
