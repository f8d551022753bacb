"""Jobs and processes over their whole life, against a real daemon: cancelling (queued, running, a
client that hangs up), deadlines that name the stage and the worker, SIGTERM with work in flight,
a worker killed with SIGKILL mid-job, sleep and wake.

Two synthetic models stand in for slow work, both reporting progress step by step. ``slow``
(``compute_ms=3000``) is for a job that must be caught running and then still finish. ``hold``
(``compute_ms=300000`` over 500 steps) is for a job that must still be running whenever the test
acts on it (cancel, deadline, disconnect, shutdown): it never finishes within a test, and stops at
the next step (well under a second) when cancelled. Both calibrate their work at load, which on a
busy machine can come out several times shorter than asked; the tests leave room for that.

Tests that only cancel or time out jobs share one daemon; the ones that stop the daemon or kill a
worker start their own. The daemons run their workers with one intra-op thread each
(``OMP_NUM_THREADS=1``): two workers on a two-core CI machine, each with two spinning OpenMP
threads, otherwise make CPU matmuls erratically ten times slower.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from daemonkit import (
    Daemon,
    delete,
    get,
    gone,
    health,
    http,
    idle,
    shared_daemon,
    sse,
    submit,
    until,
    wait_job,
    when_idle,
)

from conftest import shm_entries

SLOW = {"model": "slow", "prompt": "slow", "width": 64, "height": 64, "steps": 8}
HOLD = {"model": "hold", "prompt": "hold", "width": 64, "height": 64, "steps": 500}
FAST = {"model": "tiny", "prompt": "fast", "width": 64, "height": 64, "steps": 2}
SLOW_MODEL = "slow=synthetic:compute_ms=3000"
HOLD_MODEL = "hold=synthetic:compute_ms=300000"
ENV = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def life_daemon(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Iterator[Daemon]:
    tmp = tmp_path_factory.mktemp("life")
    args = ["--model", "tiny", "--model", SLOW_MODEL, "--model", HOLD_MODEL, "--job-timeout", "120"]
    with shared_daemon(tmp, args, model_cache, ENV) as d:
        yield d


@pytest.fixture
async def sock(life_daemon: Daemon) -> Path:
    """The shared daemon, idle: nothing queued or in flight, no slot held (a test starts clean)."""
    return await when_idle(life_daemon)


# helpers --------------------------------------------------------------------------------------
async def worker_of(s: aiohttp.ClientSession, model: str) -> dict[str, Any]:
    (w,) = [w for w in (await health(s))["workers"] if w["model"] == model]
    return w


async def computing(s: aiohttp.ClientSession, job_id: str) -> dict[str, Any]:
    """Wait until the job is running and has reported at least one step."""

    async def check() -> dict[str, Any] | None:
        job = (await get(s, f"/v1/jobs/{job_id}"))[1]
        assert job["status"] in ("queued", "running"), job
        return job if job["status"] == "running" and job["progress"]["step"] >= 1 else None

    return await until(check, 60, f"job {job_id} to report progress")


async def batches_sent(s: aiohttp.ClientSession) -> float:
    async with s.get("/metrics") as r:
        text = await r.text()
    (line,) = [x for x in text.splitlines() if x.startswith("diffusiond_batch_size_count ")]
    return float(line.split()[1])


# cancel ---------------------------------------------------------------------------------------
async def test_cancel_queued_jobs_they_never_run(sock: Path) -> None:
    async with http(sock) as s:
        first = await submit(s, HOLD)
        behind = [await submit(s, HOLD) for _ in range(2)]
        await computing(s, first["id"])
        assert (await health(s))["queue_depth"] >= 1  # the last one is waiting in the daemon's queue
        for job in behind:
            status, body = await delete(s, job["id"])
            assert status == 200, body
            assert body["status"] == "cancelled" and body["stage"] == "queued"
            assert body["error"]["code"] == "cancelled"
        sent = await batches_sent(s)
        assert (await delete(s, first["id"]))[0] == 200
        await until(lambda: idle(s), 60, "the daemon to go idle")
        assert await batches_sent(s) == sent  # nothing was dispatched for them after the cancel
        for job in behind:
            status, after = await get(s, f"/v1/jobs/{job['id']}")
            assert after["status"] == "cancelled" and after["outputs"] == []
            assert after["progress"]["step"] == 0
            assert "compute" not in after["timings_ms"] and "queued" not in after["timings_ms"], after
            async with s.delete(f"/v1/jobs/{job['id']}?finished=keep") as r:  # a cancel only, too late
                status, body = r.status, await r.json()
            assert status == 409 and body["error"]["code"] == "job_finished"
        # the worker is fine after all that
        assert (await wait_job(s, (await submit(s, FAST))["id"]))["status"] == "succeeded"


async def test_cancel_running_job_releases_everything(sock: Path) -> None:
    async with http(sock) as s:
        job = await submit(s, SLOW)
        events: list[tuple[str, dict[str, Any]]] = []

        async def follow() -> None:
            events.extend(await sse(s, job["id"]))

        follower = asyncio.create_task(follow())
        await computing(s, job["id"])
        status, body = await delete(s, job["id"])
        assert status == 200, body
        assert body["status"] == "cancelled" and body["error"]["code"] == "cancelled"
        assert body["error"]["stage"] == "computing"
        await asyncio.wait_for(follower, 30)
        assert events[-1][0] == "error" and events[-1][1]["status"] == "cancelled"
        assert "progress" in [name for name, _ in events]
        await until(lambda: idle(s), 30, "the cancelled job's worker to go idle")
        assert (await health(s))["arena_bytes_in_use"] == 0
        after = await wait_job(s, (await submit(s, SLOW))["id"])
    assert after["status"] == "succeeded", after


async def test_client_disconnect_from_sync_endpoint_cancels_the_job(sock: Path) -> None:
    prompt = f"hang up {uuid.uuid4().hex}"

    async def call() -> None:
        async with (
            http(sock) as c,
            c.post(
                "/v1/images/generations",
                json={"model": "hold", "prompt": prompt, "size": "64x64", "num_inference_steps": 500},
            ) as r,
        ):
            await r.read()

    async with http(sock) as s:
        request = asyncio.create_task(call())

        async def find() -> dict[str, Any] | None:
            jobs = (await get(s, "/v1/jobs"))[1]["data"]
            mine = [j for j in jobs if j["request"]["prompt"] == prompt]
            return mine[0] if mine and mine[0]["status"] == "running" and mine[0]["progress"]["step"] >= 1 else None

        job = await until(find, 60, "the synchronous request's job to run")
        assert not request.done()
        request.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await request
        ended = await wait_job(s, job["id"], timeout=30)
    assert ended["status"] == "cancelled", ended
    assert ended["error"]["code"] == "cancelled"


# deadlines ------------------------------------------------------------------------------------
async def test_deadline_while_computing_names_stage_and_worker(sock: Path) -> None:
    async with http(sock) as s:
        worker = await worker_of(s, "hold")
        job = await wait_job(s, (await submit(s, {**HOLD, "timeout_s": 1.0}))["id"], timeout=30)
    assert job["status"] == "failed", job
    err = job["error"]
    assert err["code"] == "deadline_exceeded" and err["stage"] == "computing"
    assert "computing" in err["message"] and "1s" in err["message"]
    assert f"worker {worker['id']} (pid {worker['pid']}" in err["message"], err


async def test_deadline_of_a_job_queued_behind_a_long_one_says_queued(sock: Path) -> None:
    async with http(sock) as s:
        long = await submit(s, HOLD)
        short = await submit(s, {**HOLD, "timeout_s": 0.5})
        job = await wait_job(s, short["id"], timeout=30)
        assert job["status"] == "failed", job
        assert job["error"]["code"] == "deadline_exceeded" and job["error"]["stage"] == "queued", job
        assert "queued" in job["error"]["message"] and "0.5s" in job["error"]["message"]
        assert (await get(s, f"/v1/jobs/{long['id']}"))[1]["status"] == "running"
        status, _ = await delete(s, long["id"])
        assert status == 200


async def test_sync_endpoint_deadline_is_504_with_the_stage(sock: Path) -> None:
    async with (
        http(sock) as s,
        s.post(
            "/v1/images/generations",
            json={"model": "hold", "prompt": "x", "size": "64x64", "num_inference_steps": 500, "timeout_s": 1},
        ) as r,
    ):
        assert r.status == 504
        err = (await r.json())["error"]
    assert err["code"] == "deadline_exceeded" and err["stage"] == "computing"


# sleep and wake -------------------------------------------------------------------------------
async def test_sleep_drains_then_holds_jobs_until_wake(sock: Path) -> None:
    async with http(sock) as s:
        running = await submit(s, SLOW)
        await computing(s, running["id"])
        try:
            async with s.post("/v1/admin/sleep") as r:
                assert r.status == 200 and (await r.json())["sleeping"] is True
            # sleep drains first: the job that was running has finished, and finished well
            _, drained = await get(s, f"/v1/jobs/{running['id']}")
            assert drained["status"] == "succeeded", drained
            h = await health(s)
            assert h["sleeping"] is True and {w["state"] for w in h["workers"]} == {"sleeping"}
            job = await submit(s, FAST)
            with pytest.raises(TimeoutError):  # asleep: the job must not end
                await asyncio.wait_for(sse(s, job["id"]), 1.5)
            _, still = await get(s, f"/v1/jobs/{job['id']}")
            assert still["status"] == "queued" and (await health(s))["queue_depth"] == 1
        finally:
            async with s.post("/v1/admin/wake") as r:
                assert r.status == 200 and (await r.json())["sleeping"] is False
        done = await wait_job(s, job["id"], timeout=60)
        assert done["status"] == "succeeded", done
        h = await health(s)
    assert h["sleeping"] is False and {w["state"] for w in h["workers"]} == {"ready"}



async def test_sleep_level_2_stops_the_workers_and_wake_starts_new_ones(life_daemon: Daemon) -> None:
    """Level 2 is for a trainer that needs the whole card: no worker process is left holding memory
    (a CUDA context included), and wake loads the models again from their files."""
    sock = await when_idle(life_daemon)
    before = set(life_daemon.worker_pids())
    assert len(before) == 3
    async with http(sock) as s:
        for bad in ("?level=3", "?level=x", "?level=1e1"):
            async with s.post(f"/v1/admin/sleep{bad}") as r:
                assert r.status == 400 and (await r.json())["error"]["field"] == "level", bad
        async with s.post("/v1/admin/sleep", json={"level": 0}) as r:
            err = (await r.json())["error"]
            assert r.status == 400 and err["field"] == "level" and "1 or 2" in err["message"]
        assert set(life_daemon.worker_pids()) == before, "a refused sleep changes nothing"
        try:
            async with s.post("/v1/admin/sleep?level=2") as r:
                answer = await r.json()
                assert r.status == 200 and (answer["sleeping"], answer["level"]) == (True, 2)
            assert not set(life_daemon.worker_pids()) & before, "every worker process has exited"
            assert (await health(s))["sleeping"] is True
            job = await submit(s, FAST)
            with pytest.raises(TimeoutError):  # asleep: the job waits
                await asyncio.wait_for(sse(s, job["id"]), 1.5)
        finally:
            async with s.post("/v1/admin/wake") as r:
                assert r.status == 200 and (await r.json())["sleeping"] is False
        done = await wait_job(s, job["id"], timeout=120)
        assert done["status"] == "succeeded", done
        after = set(life_daemon.worker_pids())
        assert len(after) == 3 and not after & before
        h = await health(s)
    assert h["sleeping"] is False and {w["state"] for w in h["workers"]} == {"ready"}

# stopping the daemon, killing a worker --------------------------------------------------------
async def test_sigterm_drains_in_flight_work_then_exits_cleanly(daemon_factory: Any) -> None:
    # --no-persist: without a state dir, what cannot finish fails with the reason (with one, it waits
    # there for the next start: test_durable.py)
    d: Daemon = daemon_factory(
        "--model", SLOW_MODEL, "--model", HOLD_MODEL, "--drain-grace-s", "120", "--job-timeout", "300",
        "--no-persist", env=ENV
    )
    assert d.proc is not None
    workers = d.worker_pids()
    assert len(workers) == 2
    streams: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    async with http(d.socket) as s:
        slow, hold = await submit(s, SLOW), await submit(s, HOLD)

        async def follow(job_id: str) -> None:
            streams[job_id] = await sse(s, job_id)

        followers = [asyncio.create_task(follow(j["id"])) for j in (slow, hold)]
        await computing(s, slow["id"])
        await computing(s, hold["id"])
        d.signal(signal.SIGTERM)

        async def draining() -> dict[str, Any] | None:
            status, body = await get(s, "/ready")
            return body if status == 503 else None

        assert (await until(draining, 10, "/ready to say draining"))["reason"] == "draining"
        async with s.post("/v1/jobs", json=SLOW) as r:
            assert r.status == 503 and (await r.json())["error"]["code"] == "unavailable"
        async with s.post("/v1/images/generations", json={"model": "slow", "prompt": "x", "size": "64x64"}) as r:
            assert r.status == 503 and (await r.json())["error"]["code"] == "unavailable"
        # the job in flight finishes within the grace period
        await asyncio.wait_for(followers[0], 60)
        assert streams[slow["id"]][-1][0] == "done"
        assert streams[slow["id"]][-1][1]["status"] == "succeeded"
        assert d.proc.poll() is None  # still draining: the hold job has not ended
        # a second signal ends the grace: what is left fails with a reason
        d.signal(signal.SIGTERM)
        await asyncio.wait_for(followers[1], 30)
    name, body = streams[hold["id"]][-1]
    assert name == "error" and body["status"] == "failed", body
    assert body["error"]["code"] == "shutting_down" and body["error"]["stage"] == "computing", body
    assert d.wait(60) == 0, d.log()
    assert not d.socket.exists()
    assert all(gone(pid) for pid in workers), [p for p in workers if not gone(p)]


async def test_worker_killed_mid_job_fails_the_job_and_is_replaced(daemon_factory: Any) -> None:
    before = shm_entries()
    d: Daemon = daemon_factory("--model", SLOW_MODEL, "--job-timeout", "300", env=ENV)
    async with http(d.socket) as s:
        old = await worker_of(s, "slow")
        assert old["restarts"] == 0 and old["pid"] in d.worker_pids()
        job = await submit(s, SLOW)
        await computing(s, job["id"])
        os.kill(old["pid"], signal.SIGKILL)
        failed = await wait_job(s, job["id"], timeout=60)
        assert failed["status"] == "failed", failed
        err = failed["error"]
        assert err["code"] == "worker_lost" and err["stage"] == "computing", err
        assert f"worker {old['id']} (pid {old['pid']}" in err["message"] and "SIGKILL" in err["message"], err

        async def replaced() -> dict[str, Any] | None:
            w = await worker_of(s, "slow")
            return w if w["pid"] != old["pid"] and w["state"] == "ready" else None

        new = await until(replaced, 60, "a replacement worker")
        assert new["restarts"] == 1
        assert gone(old["pid"]) and new["pid"] in d.worker_pids()
        h = await health(s)
        assert h["status"] == "ok" and h["arena_bytes_in_use"] == 0
        async with s.get("/metrics") as r:
            assert 'diffusiond_worker_restarts_total{model="slow"} 1.0' in await r.text()
        after = await wait_job(s, (await submit(s, SLOW))["id"])
        assert after["status"] == "succeeded", after
    assert shm_entries() - before == set()


def test_closing_the_terminal_stops_the_daemon_as_sigterm_does(daemon_factory: Any) -> None:
    """``diffusiond serve`` in a terminal that is closed gets SIGHUP: it killed the engine with no drain, its
    workers orphaned and the socket file left behind."""
    d: Daemon = daemon_factory("--model", "quick=synthetic:compute_ms=1", "--no-persist", env=ENV)
    workers = d.worker_pids()
    d.signal(signal.SIGHUP)
    assert d.wait(60) == 0, d.log()
    assert "received SIGHUP; draining" in d.log()
    assert not d.socket.exists()
    assert all(gone(pid) for pid in workers), [p for p in workers if not gone(p)]
