"""Hardening against a real daemon: SIGTERM with work queued and running, and sleep and wake
under load (a wake sent while a sleep is still draining among them). Each test starts a daemon of
its own; test_hardening.py has the rest of the hardening tests, hardeningkit.py their helpers.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections import Counter
from typing import Any

import aiohttp
from daemonkit import Daemon, gone, health, idle, sse, submit, until
from hardeningkit import ENV, SLOW, TINY, client, finished, job_state

from conftest import shm_entries


# 5. SIGTERM under load; sleep and wake under load -----------------------------------------------
async def test_sigterm_under_load_ends_every_job_and_leaves_nothing(daemon_factory: Any) -> None:
    shm_before = shm_entries()
    grace = 5.0
    # --no-persist: every job must end here (with a state dir, the unfinished wait there for the
    # next start instead: test_durable.py)
    d: Daemon = daemon_factory("--model", "tiny", "--model", "hold=synthetic:compute_ms=300000",
                               "--max-batch", "4", "--drain-grace-s", str(grace), "--job-timeout", "300",
                               "--no-persist", env=ENV)
    assert d.proc is not None
    workers = d.worker_pids()
    assert len(workers) == 2
    hold = {"model": "hold", "prompt": "hold", "width": 64, "height": 64, "steps": 500}
    streams: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    sync_answers: list[tuple[int, dict[str, Any]]] = []
    async with client(d.socket) as s:
        async def follow(job_id: str) -> None:
            streams[job_id] = await sse(s, job_id)

        async def sync_call(model: str) -> None:
            body = {"model": model, "prompt": "sync", "size": "64x64", "num_inference_steps": 2 if model == "tiny"
                    else 500}
            async with s.post("/v1/images/generations", json=body) as r:
                sync_answers.append((r.status, await r.json()))

        jobs = [await submit(s, hold)] + [await submit(s, {**TINY, "prompt": f"load {i}", "n": 1 + i % 2})
                                          for i in range(48)] + [await submit(s, hold)]
        followers = [asyncio.ensure_future(follow(j["id"])) for j in jobs]
        syncs = [asyncio.ensure_future(sync_call(m)) for m in ("tiny", "tiny", "hold")]

        async def loaded() -> bool:
            h = await health(s)
            return h["jobs"]["running"] >= 2 and h["queue_depth"] >= 1

        await until(loaded, 30, "jobs to be running and queued")
        t0 = time.monotonic()
        d.signal(signal.SIGTERM)
        await asyncio.wait_for(asyncio.gather(*followers, *syncs), grace + 60)
    code = await asyncio.to_thread(d.wait, grace + 60)
    took = time.monotonic() - t0
    assert code == 0, d.log()
    assert took < grace + 15, took  # the grace, then workers stop promptly
    outcomes: Counter[str] = Counter()
    for job in jobs:
        name, last = streams[job["id"]][-1]
        if name == "done":
            assert last["status"] == "succeeded", last
        else:
            assert name == "error" and last["status"] == "failed", last
            assert last["error"]["code"] == "shutting_down", last
        outcomes[last["status"]] += 1
    for job in (jobs[0], jobs[-1]):  # hold jobs cannot finish: they end with the reason
        assert streams[job["id"]][-1][1]["error"]["code"] == "shutting_down"
    assert outcomes["succeeded"] >= 1, outcomes
    assert len(sync_answers) == 3
    for status, body in sync_answers:
        assert status == 200 or (status == 503 and body["error"]["code"] == "shutting_down"), (status, body)
    assert not d.socket.exists()
    assert all(gone(pid) for pid in workers), [p for p in workers if not gone(p)]
    assert shm_entries() - shm_before == set()


async def test_sleep_and_wake_under_load_every_job_succeeds(daemon_factory: Any) -> None:
    d: Daemon = daemon_factory("--model", "tiny", "--model", "slow=synthetic:compute_ms=1500", "--workers", "1",
                               "--max-batch", "4", "--job-timeout", "300", env=ENV)
    async with client(d.socket) as s:
        jobs = [await submit(s, {**SLOW, "prompt": "slow"})]
        jobs += [await submit(s, {**TINY, "prompt": f"sleepy {i}"}) for i in range(24)]
        jobs += [await submit(s, {**SLOW, "prompt": "slow 2"})]

        async def running() -> bool:
            return (await job_state(s, jobs[0]["id"]))["progress"]["step"] >= 1

        await until(running, 30, "the slow job to compute")
        async with s.post("/v1/admin/sleep") as r:
            assert r.status == 200 and (await r.json())["sleeping"] is True
        h = await health(s)
        assert h["sleeping"] is True and {w["state"] for w in h["workers"]} == {"sleeping"}, h
        states = [await job_state(s, j["id"]) for j in jobs]
        # drained: what had started has finished, the rest waits; none lost
        assert all(j["status"] in ("queued", "succeeded") for j in states), [(j["status"], j["stage"]) for j in states]
        assert h["queue_depth"] == sum(j["status"] == "queued" for j in states)
        async with s.post("/v1/admin/wake") as r:
            assert r.status == 200 and (await r.json())["sleeping"] is False
        ends = [await finished(s, j["id"], 120) for j in jobs]
        assert [j["status"] for j in ends] == ["succeeded"] * len(jobs), ends
        await until(lambda: idle(s), 30, "the daemon to go idle")
        h = await health(s)
    assert h["sleeping"] is False and {w["state"] for w in h["workers"]} == {"ready"}, h


async def test_wake_sent_while_sleep_is_still_draining_leaves_the_daemon_awake(daemon_factory: Any) -> None:
    """A wake that arrives while a sleep is still draining must not be lost: the two are applied
    in order, so the daemon ends awake and every job runs (not queued forever behind workers the
    engine believes are awake but that went to sleep after the wake)."""
    d: Daemon = daemon_factory("--model", "slow=synthetic:compute_ms=1500", "--job-timeout", "300", env=ENV)
    async with client(d.socket) as s:
        first = await submit(s, SLOW)

        async def running() -> bool:
            return (await job_state(s, first["id"]))["progress"]["step"] >= 1

        await until(running, 30, "the slow job to compute")
        queued = [await submit(s, SLOW) for _ in range(2)]

        async def post(path: str) -> tuple[int, dict[str, Any]]:
            async with s.post(path) as r:
                return r.status, await r.json()

        sleeping = asyncio.ensure_future(post("/v1/admin/sleep"))
        await until(lambda: _paused(s), 10, "the sleep to begin draining")
        woke = await post("/v1/admin/wake")
        slept = await asyncio.wait_for(sleeping, 60)
        assert slept[0] == 200 and woke[0] == 200, (slept, woke)
        ends = [await finished(s, j["id"], 60) for j in (first, *queued)]
        assert [j["status"] for j in ends] == ["succeeded"] * 3, ends
        h = await health(s)
        assert h["sleeping"] is False and {w["state"] for w in h["workers"]} == {"ready"}, h
        assert h["status"] == "ok", h
        # and work submitted now runs (it would wait forever for a worker left asleep)
        assert (await finished(s, (await submit(s, SLOW))["id"], 60))["status"] == "succeeded"


async def _paused(s: aiohttp.ClientSession) -> bool:
    return bool((await health(s))["sleeping"])


async def test_sigterm_with_a_worker_inside_one_long_step_stops_within_the_grace_and_the_workers_bound(
        daemon_factory: Any) -> None:
    """A worker inside a forward answers nothing until it ends (one synthetic step of five minutes here, as a
    4000² edit on a small model was): the daemon waits its drain grace, then the worker's own 10 s, then kills it,
    which systemd's TimeoutStopSec (docs/systemd.md) is set above. It waited the grace three times before
: past the unit's 60 s with the default 30 s grace, so systemd killed the engine mid-stop."""
    grace = 12.0
    d: Daemon = daemon_factory("--model", "hold=synthetic:compute_ms=300000", "--drain-grace-s", str(grace),
                               "--job-timeout", "600", env=ENV)
    workers = d.worker_pids()
    async with client(d.socket) as s:
        job = await submit(s, {"model": "hold", "prompt": "one long step", "width": 64, "height": 64, "steps": 1})
        await until(lambda: _running(s, job["id"]), 30, "the job to be running")
        t0 = time.monotonic()
        d.signal(signal.SIGTERM)
    code = await asyncio.to_thread(d.wait, 120)
    took = time.monotonic() - t0
    assert code == 0, d.log()
    assert took < grace + 10 + 8, (took, d.log()[-3000:])  # the grace, then the worker's 10 s, then its kill
    assert "did not exit within 10s; killing it" in d.log()
    assert all(gone(pid) for pid in workers)


async def _running(s: aiohttp.ClientSession, job_id: str) -> bool:
    return (await job_state(s, job_id))["status"] == "running"
