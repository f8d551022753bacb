"""Hardening against a real daemon, on one shared "race" daemon: cancel races across every
stage, deadlines in the copying and encoding stages (and a cancel while encoding), and requests for
outputs over the limits.

Large outputs and the arena are test_hardening_outputs.py's; SIGTERM and sleep/wake with work queued
and running are test_hardening_shutdown.py's; the helpers they share are hardeningkit.py's.

Every test talks to a ``diffusiond serve`` subprocess over its Unix socket; nothing is mocked.
Slow stages are made wide on purpose, never waited out with sleeps: the worker fault
``copy_delay_ms=200`` holds every copy 200 ms (so "copying" lasts 200 ms per output), one encode
thread with a long video in it keeps later outputs in "encoding", and synthetic models give a
compute stage of known length. Daemons run their workers with one math thread each
(``OMP_NUM_THREADS=1``; see test_daemon_lifecycle.py for why).
"""

from __future__ import annotations

import asyncio
import os
import random
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from daemonkit import Daemon, cancel, delete, health, idle, shared_daemon, sse, submit, until, when_idle
from hardeningkit import ENV, SLOW, TERMINAL, TINY, client, fetch, finished, job_state

# The shared "race" daemon: every copy takes 200 ms, one encode thread (TINY and SLOW: hardeningkit.py).
COPY = {"model": "cp", "prompt": "race", "width": 64, "height": 64, "steps": 2}  # ~nothing but copying
PNG_1K = {"model": "cp", "prompt": "race", "width": 1024, "height": 1024, "steps": 2}  # a real PNG encode
VIDEO = {"model": "vid", "prompt": "race", "width": 128, "height": 128, "steps": 2, "num_frames": 16}
# Seconds of mp4 encoding on one thread (more on a slower machine): holds the encode pool.
LONG_VIDEO = {"model": "vid", "prompt": "hold the encoder", "width": 512, "height": 512, "steps": 2,
              "num_frames": 128}


# helpers --------------------------------------------------------------------------------------
async def reaches(s: aiohttp.ClientSession, job_id: str, stage: str, timeout: float = 60) -> dict[str, Any]:
    """Wait until the job is in ``stage`` (or has ended: the caller checks which)."""

    async def check() -> dict[str, Any] | None:
        job = await job_state(s, job_id)
        return job if job["stage"] == stage or job["status"] in TERMINAL else None

    return await until(check, timeout, f"job {job_id} to reach {stage}")


async def jobs_total(s: aiohttp.ClientSession) -> Counter[str]:
    """``diffusiond_jobs_total`` by status, from /metrics."""
    async with s.get("/metrics") as r:
        text = await r.text()
    counts: Counter[str] = Counter()
    for m in re.finditer(r'^diffusiond_jobs_total\{status="(\w+)"\} ([0-9.e+]+)$', text, re.M):
        counts[m.group(1)] = int(float(m.group(2)))
    return counts


# the shared race daemon -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def race_daemon(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Iterator[Daemon]:
    with shared_daemon(tmp_path_factory.mktemp("race"), [
        "--model", "tiny", "--model", "slow=synthetic:compute_ms=400", "--model", "cp=synthetic:compute_ms=1",
        "--model", "vid=synthetic:task=video,compute_ms=20",
        "--max-batch", "4", "--encode-threads", "1", "--job-timeout", "120",
        "--test-fault", "copy_delay_ms=200",
    ], model_cache, ENV) as d:
        yield d


@pytest.fixture
async def race(race_daemon: Daemon) -> Path:
    """The race daemon, idle: nothing queued or in flight, no slot held."""
    return await when_idle(race_daemon)


# 1. cancel races ------------------------------------------------------------------------------
RACE_BODIES = [TINY, SLOW, COPY, SLOW, {**COPY, "n": 3}, PNG_1K, VIDEO]  # slow ones queue up
WHEN = ("immediately", "random", "after_progress", "in_copying", "in_encoding", "after_done", "never")
RACE_JOBS = 120


async def test_cancel_races_every_job_ends_once_and_counters_agree(race: Path) -> None:
    seed = int(os.environ.get("HARDENING_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    plan = [(RACE_BODIES[i % len(RACE_BODIES)], WHEN[rng.randrange(len(WHEN))], rng.uniform(0, 1.5),
             rng.uniform(0, 1.5)) for i in range(RACE_JOBS)]
    results: list[dict[str, Any]] = []

    async with client(race) as s:
        before = await jobs_total(s)

        async def one(i: int) -> None:
            body, when, start_at, delay = plan[i]
            await asyncio.sleep(start_at)  # spread the submissions so they land on busy workers
            job = await submit(s, {**body, "prompt": f"race {i}", "seed": i})
            job_id = job["id"]
            follower = asyncio.ensure_future(sse(s, job_id)) if i % 2 == 0 else None
            answer: tuple[int, dict[str, Any]] | None = None
            if when == "immediately":
                answer = await cancel(s, job_id)
            elif when == "random":
                await asyncio.sleep(delay)
                answer = await cancel(s, job_id)
            elif when == "after_progress":
                async def progressed() -> bool:
                    j = await job_state(s, job_id)
                    return j["progress"]["step"] >= 1 or j["status"] in TERMINAL

                await until(progressed, 60, f"job {job_id} to report progress")
                answer = await cancel(s, job_id)
            elif when in ("in_copying", "in_encoding"):
                await reaches(s, job_id, when[3:])
                answer = await cancel(s, job_id)
            elif when == "after_done":
                await finished(s, job_id)
                answer = await cancel(s, job_id)
            final = await finished(s, job_id)
            events = await asyncio.wait_for(follower, 60) if follower else await sse(s, job_id)
            again = await cancel(s, job_id)  # a finished job stays finished
            results.append({"i": i, "id": job_id, "when": when, "answer": answer, "final": final,
                            "events": events, "again": again})

        await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(RACE_JOBS))), 240)
        await until(lambda: idle(s), 60, "the daemon to go idle after the races (queue 0, arena 0)")
        after = await jobs_total(s)
        seen: Counter[str] = Counter()
        cancelled_in: Counter[str] = Counter()
        for r in results:
            where = f"seed {seed}, job {r['i']} ({r['when']}): {r}"
            final = r["final"]
            status = final["status"]
            seen[status] += 1
            # it stays where it ended, and the stream's last event says the same
            later = await job_state(s, r["id"])
            assert (later["status"], later["error"]) == (status, final["error"]), where
            name, last = r["events"][-1]
            assert name == ("done" if status == "succeeded" else "error"), where
            assert (last["status"], last["error"]) == (status, final["error"]), where
            assert [n for n, _ in r["events"]].count(name) == 1, where
            assert r["again"][0] == 409 and r["again"][1]["error"]["code"] == "job_finished", where
            assert status in ("succeeded", "cancelled"), where  # nothing here may fail
            if r["answer"] is None:
                assert status == "succeeded", where
                continue
            code, body = r["answer"]
            if code == 200:
                assert body["status"] == "cancelled" and body["error"]["code"] == "cancelled", where
                assert status == "cancelled" and final["error"]["stage"] == body["error"]["stage"], where
                cancelled_in[body["error"]["stage"]] += 1
            else:
                assert code == 409 and body["error"]["code"] == "job_finished", where
                assert status == "succeeded" and "(succeeded)" in body["error"]["message"], where
            if r["when"] == "after_done":
                assert code == 409, where
            if status == "succeeded":  # and its outputs are all there
                assert len(final["outputs"]) == final["request"]["n"], where
                for out in final["outputs"]:
                    assert len(await fetch(s, out["url"])) == out["bytes"] > 0, where
        # the daemon's own counters agree with what the clients saw
        assert {k: after[k] - before[k] for k in TERMINAL} == {k: seen[k] for k in TERMINAL}, (seed, seen)
        h = await health(s)
        assert h["queue_depth"] == 0 and h["arena_bytes_in_use"] == 0, h
        assert all(w["restarts"] == 0 and w["state"] == "ready" for w in h["workers"]), h
        # the wide stages were all hit by a cancel (encoding is hit deterministically below)
        assert {"queued", "computing", "copying"} <= set(cancelled_in), (seed, cancelled_in)
        nxt = await finished(s, (await submit(s, TINY))["id"])
        assert nxt["status"] == "succeeded", nxt


# 4. deadlines in the copying and encoding stages (and a cancel while encoding) -----------------
async def test_deadline_while_copying_names_the_stage_and_worker(race: Path) -> None:
    async with client(race) as s:
        (worker,) = [w for w in (await health(s))["workers"] if w["model"] == "cp"]
        # 16 outputs at 200 ms of copying each: the job is "copying" from ~0.05 s to ~3.2 s
        job = await submit(s, {**COPY, "n": 16, "timeout_s": 1.0})
        ended = await finished(s, job["id"], 30)
        assert ended["status"] == "failed", ended
        err = ended["error"]
        assert err["code"] == "deadline_exceeded" and err["stage"] == "copying", err
        assert "while copying" in err["message"] and "1s" in err["message"], err
        assert f"worker {worker['id']} (pid {worker['pid']}" in err["message"], err
        assert len(ended["outputs"]) < 16  # those copied in time stay listed; the rest never will be
        await until(lambda: idle(s), 30, "the slots of the copies after the deadline to come back")
        assert (await finished(s, (await submit(s, COPY))["id"]))["status"] == "succeeded"


async def test_deadline_and_cancel_while_encoding(race: Path) -> None:
    async with client(race) as s:
        long = await submit(s, LONG_VIDEO)
        assert (await reaches(s, long["id"], "encoding", 90))["stage"] == "encoding"
        # the one encode thread is busy for seconds: what arrives now waits in "encoding"
        late = await submit(s, {**COPY, "timeout_s": 1.5})
        cancel = await submit(s, COPY)
        seen = await reaches(s, cancel["id"], "encoding")
        assert seen["stage"] == "encoding", seen
        code, body = await delete(s, cancel["id"])
        assert code == 200 and body["status"] == "cancelled", body
        assert body["error"]["stage"] == "encoding", body
        ended = await finished(s, late["id"], 30)
        assert ended["status"] == "failed", ended
        assert ended["error"]["code"] == "deadline_exceeded" and ended["error"]["stage"] == "encoding", ended
        assert "while encoding" in ended["error"]["message"], ended
        assert (await job_state(s, long["id"]))["status"] == "running"  # the test held what it meant to
        done = await finished(s, long["id"], 120)
        assert done["status"] == "succeeded", done
        assert len(await fetch(s, done["outputs"][0]["url"])) == done["outputs"][0]["bytes"] > 0
        await until(lambda: idle(s), 30, "every slot to come back")
        assert (await finished(s, (await submit(s, COPY))["id"]))["status"] == "succeeded"


# 3. (the API side) outputs over the limits -----------------------------------------------------
async def test_outputs_over_the_limits_are_400_naming_the_field(race: Path) -> None:
    cases: list[tuple[str, dict[str, Any], str]] = [
        ("/v1/jobs", {**COPY, "width": 4104}, "width"),
        ("/v1/jobs", {**COPY, "height": 8192}, "height"),
        ("/v1/jobs", {**COPY, "width": 10**12}, "width"),
        ("/v1/jobs", {**COPY, "n": 17}, "n"),
        ("/v1/jobs", {**VIDEO, "num_frames": 1025}, "num_frames"),
        ("/v1/jobs", {**VIDEO, "num_frames": 2**64}, "num_frames"),
        ("/v1/jobs", {**COPY, "steps": 501}, "steps"),
        ("/v1/images/generations", {"model": "cp", "prompt": "x", "size": "8192x8192"}, "size"),
        ("/v1/images/generations", {"model": "cp", "prompt": "x", "size": "99999999x8"}, "size"),
        ("/v1/images/generations", {"model": "cp", "prompt": "x", "n": 100}, "n"),
    ]
    async with client(race) as s:
        for path, body, field in cases:
            async with s.post(path, json=body) as r:
                answer = await r.json()
                assert r.status == 400, (body, answer)
            assert answer["error"]["field"] == field and answer["error"]["message"], (body, answer)
        h = await health(s)
        assert h["status"] == "ok" and h["jobs"]["queued"] == 0 and h["jobs"]["running"] == 0, h
