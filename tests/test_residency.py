"""The residency room's rules, step by step, against a fake engine that carries out its decisions
(residencykit.py): fit, evict, the host tier, keep-alive, pin, models too large, pressure from other
programs, out-of-memory retries and the measurements of working memory. The transitions (a worker
dying mid-load among them), reports that contradict the state and random request streams that never
break the budget are test_residency_transitions.py's."""

from __future__ import annotations

import pytest
from residencykit import Engine, G, S, on_device, room, tier

from diffusiond.daemon.residency import decisions as dec
from diffusiond.daemon.residency.decisions import Evict, Fits, TooLarge, Wait
from diffusiond.daemon.residency.policy import Residency
from diffusiond.daemon.residency.units import FOREVER
from diffusiond.daemon.residency.working import Measurements, Shape


def test_a_budget_that_holds_one_of_three_models_serves_a_b_c_a_b_c() -> None:
    e = Engine(room())
    for name in "abcabc":
        e.run(name)
        assert on_device(e.r) == [name]
    assert all(mv.reason == f"making room for {nxt} on cuda:0" for mv, nxt in zip(e.moves, "bcabc", strict=True))
    assert [src for _, src in e.loads] == ["disk"] * 6  # no host tier: every model comes back from its files


def test_evicted_models_wait_in_host_memory_and_its_least_recently_used_drop_to_disk() -> None:
    e = Engine(room(host=9 * G))  # host memory holds two
    for name in "abc":
        e.run(name)
    assert (tier(e.r, "a"), tier(e.r, "b"), tier(e.r, "c")) == ("host", "host", "device")
    e.run("a")
    assert e.loads[-1] == ("a", "host")
    # c left the device before a's host copy was freed (a loads after c's move), so b made room for it
    assert (tier(e.r, "b"), tier(e.r, "c")) == ("disk", "host")
    assert e.r.host_used() == 4 * G
    e2 = Engine(room(host=5 * G))  # holds one
    for name in "abc":
        e2.run(name)
    assert (tier(e2.r, "a"), tier(e2.r, "b")) == ("disk", "host")
    drop = next(mv for mv in e2.moves if mv.src == "host")
    assert drop.model == "a" and "host memory is full" in drop.reason
    snap = {s.name: s for s in e2.r.snapshot()}
    assert snap["b"].host_bytes == 4 * G and snap["b"].device_bytes == 0 and snap["a"].host_bytes == 0


def test_a_model_more_recent_than_the_host_models_is_not_dropped_for_an_older_one() -> None:
    r = room(host=5 * G)
    e = Engine(r)
    e.run("a")
    e.run("b")  # a -> host
    assert tier(r, "a") == "host"
    d = r.evict("b", "by hand")
    assert isinstance(d, Evict) and [(m.model, m.dst) for m in d.moves] == [("a", "disk"), ("b", "host")]


def test_models_that_fit_together_stay_together() -> None:
    e = Engine(room(budget=20 * G))
    for name in "abcabc":
        e.run(name)
    assert sorted(on_device(e.r)) == ["a", "b", "c"] and not e.moves


def test_a_pinned_model_stays() -> None:
    r = Residency({"cuda:0": 10 * G}, 0)
    r.add("p", "cuda:0", 4 * G, pinned=True)
    for name in "ab":
        r.add(name, "cuda:0", 4 * G)
    for name in "pab":
        r.measured(name, S, G)
    e = Engine(r)
    for name in "pabab":
        e.run(name)
        assert "p" in on_device(r)
    assert all(mv.model != "p" for mv in e.moves)
    assert r.expired(1e12) == tuple(mv for mv in r.expired(1e12) if mv.model != "p")
    assert "p" not in [mv.model for mv in r.expired(1e12)]
    assert [s.pinned for s in r.snapshot() if s.name == "p"] == [True]
    d = r.evict("p", "unloaded by request")  # by hand, a pinned model leaves too
    assert isinstance(d, Evict) and [mv.model for mv in d.moves] == ["p"]


def test_a_model_with_a_queued_or_running_job_is_never_evicted() -> None:
    r = room()
    e = Engine(r)
    e.run("a")
    r.queue("a")
    d = r.plan("b", S)
    assert isinstance(d, Wait) and d.stage == dec.WAITING_FOR_MEMORY
    r.start("a", S, e.now)
    d = r.plan("b", S)
    assert isinstance(d, Wait) and "waiting for the runs of a" in d.reason
    assert isinstance(r.evict("a", "by hand"), Wait)
    r.finish("a", S, e.now)
    d = r.plan("b", S)
    assert isinstance(d, Evict) and [mv.model for mv in d.moves] == ["a"]


def test_evicts_the_least_recently_used_idle_model_first_and_only_as_many_as_needed() -> None:
    r = room(budget=13 * G, models={"a": 4 * G, "b": 4 * G, "c": 4 * G, "d": 4 * G})
    e = Engine(r)
    for name in "bac":
        e.run(name)
    d = r.plan("d", S)
    assert isinstance(d, Evict) and [mv.model for mv in d.moves] == ["b"]


def test_keep_alive_expires_and_every_job_resets_it() -> None:
    r = room(budget=20 * G)
    e = Engine(r)
    e.run("a")  # finished at t=1; default keep-alive 5 minutes
    assert r.next_expiry() == 301
    assert r.expired(300.9) == ()
    e.now = 200
    e.run("a")  # finished at 201
    assert r.expired(301) == () and r.next_expiry() == 501
    (mv,) = r.expired(501)
    assert (mv.model, mv.src, mv.dst, mv.reason) == ("a", "device", "disk", "keep_alive expired")
    snap = next(s for s in r.snapshot() if s.name == "a")
    assert snap.keep_alive_until == 501 and not snap.forever


def test_keep_alive_zero_leaves_at_once_and_minus_one_never() -> None:
    r = room(budget=20 * G)
    e = Engine(r)
    e.run("a", keep_alive_s=0)
    assert [mv.model for mv in r.expired(e.now)] == ["a"]
    e.run("b", keep_alive_s=FOREVER)
    assert "b" not in [mv.model for mv in r.expired(1e15)]
    snap = next(s for s in r.snapshot() if s.name == "b")
    assert snap.keep_alive_until is None and snap.forever
    r.queue("a")  # a model with work does not expire, whatever its deadline
    assert r.expired(1e15) == ()


def test_a_requested_keep_alive_is_capped_and_a_models_own_overrides_the_default() -> None:
    r = Residency({"cuda:0": 20 * G}, 0, keep_alive_s=300, max_keep_alive_s=600)
    r.add("a", "cuda:0", G)
    r.add("t", "cuda:0", G, keep_alive_s=1800)
    assert r.keep_alive_for("a", None) == 300
    assert r.keep_alive_for("t", None) == 1800  # the admin's TOML is not capped
    assert r.keep_alive_for("a", 3600) == 600
    assert r.keep_alive_for("a", FOREVER) == 600  # a client cannot pin memory the admin did not allow
    assert r.keep_alive_for("a", 0) == 0
    with pytest.raises(ValueError, match="negative"):
        r.keep_alive_for("a", -1)
    r.touch("a", 3600, now=10)
    assert r.next_expiry() is None  # not on the device: nothing to expire
    e = Engine(r)
    e.run("a", keep_alive_s=3600)
    assert r.next_expiry() == e.now + 600


def test_a_model_that_cannot_fit_even_alone_is_too_large_with_what_would_make_it_fit() -> None:
    r = Residency({"cuda:0": 6 * G}, 0)
    r.add("big", "cuda:0", 8 * G)
    r.add("q", "cuda:0", 8 * G, hints=("--quantize fp8 (this model supports it)",))
    d = r.plan("big", S)
    assert isinstance(d, TooLarge) and d.code == "model_too_large"
    assert (d.need, d.budget) == (8 * G, 6 * G)
    assert "needs 8.00 GiB" in d.reason and "budget there is 6.00 GiB" in d.reason
    assert "--device-memory for cuda:0 (at least 8.00 GiB)" in d.reason
    assert "offloading" in d.reason and "quantized" in d.reason
    q = r.plan("q", None)
    assert isinstance(q, TooLarge) and "--quantize fp8" in q.reason and "offloading" not in q.reason


def test_measured_working_memory_counts_towards_too_large_but_a_guess_does_not() -> None:
    r = Residency({"cuda:0": 6 * G}, 0)
    r.add("m", "cuda:0", 5 * G)
    big = Shape(2048, 2048, 4)
    assert isinstance(r.plan("m", big), Fits)  # not measured: the default guess is large, but only a guess
    r.measured("m", big, 2 * G)
    d = r.plan("m", big)
    assert isinstance(d, TooLarge) and d.need == 7 * G
    assert "2.00 GiB of working memory for 2048x2048, batch 4" in d.reason and "smaller size or batch" in d.reason


def test_pinned_models_can_make_another_too_large() -> None:
    r = Residency({"cuda:0": 10 * G}, 0)
    r.add("p", "cuda:0", 4 * G, pinned=True)
    r.add("m", "cuda:0", 7 * G)
    Engine(r).run("p")
    d = r.plan("m", None)
    assert isinstance(d, TooLarge) and "unpinning p" in d.reason and "p (pinned) hold 4.00 GiB" in d.reason


def test_pressure_from_other_programs_evicts_idle_models_and_makes_jobs_wait() -> None:
    r = room(budget=20 * G, models={"a": 4 * G, "b": 4 * G, "c": 4 * G})
    e = Engine(r)
    for name in "abc":
        e.run(name)
    assert r.pressure("cuda:0", free_bytes=10 * G, reserve_bytes=G).moves == ()
    p = r.pressure("cuda:0", free_bytes=G // 2, reserve_bytes=G)
    assert [mv.model for mv in p.moves] == ["a"] and not p.waiting
    assert "other programs need the memory" in p.moves[0].reason
    e.move(p.moves)
    d = r.plan("a", S)  # a came back: no room left beside other programs
    assert isinstance(d, Evict)
    r.queue("b")
    r.queue("c")
    p = r.pressure("cuda:0", free_bytes=0, reserve_bytes=12 * G)
    assert p.moves == () and p.waiting and "new jobs wait for memory" in p.reason
    d = r.plan("a", S)
    assert isinstance(d, Wait) and d.stage == dec.WAITING_FOR_MEMORY and "other programs" in d.reason
    r.pressure("cuda:0", free_bytes=30 * G, reserve_bytes=G)
    assert isinstance(r.plan("a", S), Fits)


def test_pressure_counts_models_already_leaving_and_never_takes_a_pinned_one() -> None:
    r = Residency({"cuda:0": 20 * G}, 0)
    r.add("p", "cuda:0", 4 * G, pinned=True)
    r.add("a", "cuda:0", 4 * G)
    r.add("b", "cuda:0", 4 * G)
    e = Engine(r)
    for name in "pab":
        e.run(name)
    first = r.pressure("cuda:0", free_bytes=0, reserve_bytes=3 * G)
    assert [mv.model for mv in first.moves] == ["a"]
    r.unloading(first.moves[0])
    again = r.pressure("cuda:0", free_bytes=0, reserve_bytes=3 * G)
    assert again.moves == ()  # a's 4 GiB are on their way out already
    worse = r.pressure("cuda:0", free_bytes=0, reserve_bytes=20 * G)
    assert [mv.model for mv in worse.moves] == ["b"] and worse.waiting


def test_out_of_memory_evicts_idle_models_retries_splits_and_then_fails_the_job_only() -> None:
    r = room(budget=20 * G)
    e = Engine(r)
    for name in "abc":
        e.run(name)
    r.queue("c")
    batch = Shape(1024, 1024, 4)
    first = r.on_oom("a", batch, attempt=0)
    assert isinstance(first, dec.OomRetry) and [mv.model for mv in first.moves] == ["b"]  # c has work
    split = r.on_oom("a", batch, attempt=1)
    assert isinstance(split, dec.OomSplit) and split.halves == (Shape(1024, 1024, 2), Shape(1024, 1024, 2))
    assert r.on_oom("a", Shape(64, 64, 3), 1).halves == (Shape(64, 64, 2), Shape(64, 64, 1))  # type: ignore
    fail = r.on_oom("a", split.halves[0], attempt=2)
    assert isinstance(fail, dec.OomFail) and fail.code == "out_of_memory"
    assert "1024x1024, batch 2" in fail.reason and "budget is 20.00 GiB" in fail.reason
    assert "halves" in fail.reason
    single = r.on_oom("a", S, attempt=1)
    assert isinstance(single, dec.OomFail) and "64x64, batch 1" in single.reason
    # a model's own hints close the failure, as they close its model_too_large refusal (a stream model's: keep
    # fewer blocks; too_large.too_large_hints)
    r.add("s", "cuda:0", 2 * G, hints=("fewer resident blocks (resident_blocks=N)",))
    assert r.on_oom("s", S, attempt=1).reason.endswith(", or fewer resident blocks (resident_blocks=N)")


def test_measurements_are_used_and_round_trip_through_the_state_dir() -> None:
    r = room()
    r.measured("a", Shape(512, 512), 3 * G)
    assert r.estimate("a", Shape(512, 512)).nbytes == 3 * G
    assert r.estimate("a", Shape(256, 256)).nbytes == 3 * G  # the smallest larger shape bounds it
    assert r.estimate("a", Shape(1024, 1024)).nbytes == int(3 * G * 4 * 1.25)  # from 512x512, the largest
    r.add("new", "cuda:0", G)
    assert not r.estimate("new", S).measured
    back = Measurements.from_dict(r.measurements.to_dict())
    assert back.to_dict() == r.measurements.to_dict()
    r2 = room(measurements=back)
    assert r2.estimate("a", Shape(512, 512)).measured
    r3 = Residency({"cuda:0": G}, 0, measurements=back)
    r3.add("a", "cuda:0", 5 * G)  # another model under the name: the old peaks say nothing
    assert not r3.estimate("a", Shape(512, 512)).measured


@pytest.mark.parametrize(("data", "expected"), [
    ([], "version"), ({"version": 2, "models": {}}, "version"), ({"version": 1}, "models"),
    ({"version": 1, "models": {"a": {"weight_bytes": -1, "peaks": {}}}}, "weight_bytes"),
    ({"version": 1, "models": {"a": {"weight_bytes": 1, "peaks": {"64x64": 1}}}}, "WIDTHxHEIGHTxBATCHxFRAMES"),
    ({"version": 1, "models": {"a": {"weight_bytes": 1, "peaks": {"64x64x1x1": "x"}}}}, "non-negative integer"),
])
def test_a_damaged_measurements_file_is_refused_clearly(data: object, expected: str) -> None:
    with pytest.raises(ValueError, match=expected):
        Measurements.from_dict(data)


def test_a_model_on_two_devices_is_counted_on_each_and_makes_room_on_each() -> None:
    """Issue 27: a worker per device, each with its copy; before, only the first device counted it."""
    r = Residency({"cuda:0": 10 * G, "cuda:1": 6 * G}, 0)
    r.add("x", "cuda:1", 4 * G)
    r.add("m", ("cuda:0", "cuda:1"), 4 * G)
    for name in "xm":
        r.measured(name, S, G)
    e = Engine(r)
    e.run("x")
    e.run("m")  # cuda:0 has room; cuda:1 only once x leaves
    assert on_device(r) == ["m"] and [mv.model for mv in e.moves] == ["x"]
    assert "on cuda:1" in e.moves[0].reason
    assert (r.device_used("cuda:0"), r.device_used("cuda:1")) == (4 * G, 4 * G)
    assert {s.name: s.per_device for s in r.snapshot()}["m"] == {"cuda:0": 4 * G, "cuda:1": 4 * G}
    r.queue("m")
    r.start("m", S, e.now, device="cuda:1")  # a run holds working memory on its worker's device only
    assert (r.device_used("cuda:0"), r.device_used("cuda:1")) == (4 * G, 5 * G)
    r.finish("m", S, e.now, device="cuda:1")
    big = Residency({"cuda:0": 10 * G, "cuda:1": 6 * G}, 0)
    big.add("m", ("cuda:0", "cuda:1"), 7 * G)
    refused = big.plan("m", None)
    assert isinstance(refused, TooLarge) and refused.device == "cuda:1" and "cuda:1" in refused.reason
    assert big.preload(["m"]) == []
