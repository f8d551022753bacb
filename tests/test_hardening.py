"""Hardening against a real daemon: cancel races across every
stage, clients that stall or vanish in the middle of a large output or never fetch it, outputs
larger than the arena and an arena that is full, deadlines in the copying and encoding stages,
SIGTERM and sleep/wake with work queued and running, and requests for outputs over the limits.

Large outputs are ``npy`` (streamed from the arena, the slot given back once streamed in full;
unfetched ones spilled out of the arena once they hold over half of it; the rest released when
retention ends): a reader that stalls keeps its slot pinned and must block nobody else, a reader
that hangs up must leak no pin, and the arena must come back to 0 bytes in use every time.

Every test talks to a ``diffusiond serve`` subprocess over its Unix socket; nothing is mocked.
Slow stages are made wide on purpose, never waited out with sleeps: the worker fault
``copy_delay_ms=200`` holds every copy 200 ms (so "copying" lasts 200 ms per output), one encode
thread with a long video in it keeps later outputs in "encoding", and synthetic models give a
compute stage of known length. Daemons run their workers with one math thread each
(``OMP_NUM_THREADS=1``; see test_daemon_lifecycle.py for why).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import random
import re
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from daemonkit import (
    Daemon,
    cancel,
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
    when_idle,
)

from conftest import memfd_maps, shm_entries

ENV = {"OMP_NUM_THREADS": "1"}
TERMINAL = ("succeeded", "failed", "cancelled")
MIB = 1 << 20

# The shared "race" daemon: every copy takes 200 ms, one encode thread.
TINY = {"model": "tiny", "prompt": "race", "width": 64, "height": 64, "steps": 2}
SLOW = {"model": "slow", "prompt": "race", "width": 64, "height": 64, "steps": 8}  # ~400 ms computing
COPY = {"model": "cp", "prompt": "race", "width": 64, "height": 64, "steps": 2}  # ~nothing but copying
PNG_1K = {"model": "cp", "prompt": "race", "width": 1024, "height": 1024, "steps": 2}  # a real PNG encode
VIDEO = {"model": "vid", "prompt": "race", "width": 128, "height": 128, "steps": 2, "num_frames": 16}
# Seconds of mp4 encoding on one thread (more on a slower machine): holds the encode pool.
LONG_VIDEO = {"model": "vid", "prompt": "hold the encoder", "width": 512, "height": 512, "steps": 2,
              "num_frames": 128}

# The "big" daemon: 48 MiB float32 outputs, an arena with room for three of them.
BIG = {"model": "big", "prompt": "big", "width": 2048, "height": 2048, "steps": 2,
       "output_format": "npy", "output_dtype": "float32"}
BIG_BYTES = 2048 * 2048 * 3 * 4


# helpers --------------------------------------------------------------------------------------
def client(sock: Path) -> contextlib.AbstractAsyncContextManager[aiohttp.ClientSession]:
    """``daemonkit.http`` without the connection cap: race tests keep many streams open."""
    return http(sock, limit=0)


async def job_state(s: aiohttp.ClientSession, job_id: str) -> dict[str, Any]:
    status, job = await get(s, f"/v1/jobs/{job_id}")
    assert status == 200, job
    return job


async def finished(s: aiohttp.ClientSession, job_id: str, timeout: float = 120) -> dict[str, Any]:
    async def check() -> dict[str, Any] | None:
        job = await job_state(s, job_id)
        return job if job["status"] in TERMINAL else None

    return await until(check, timeout, f"job {job_id} to end")


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


async def fetch(s: aiohttp.ClientSession, url: str) -> bytes:
    async with s.get(url) as r:
        assert r.status == 200, await r.text()
        return await r.read()


def load_npy(data: bytes) -> np.ndarray:
    return np.load(io.BytesIO(data), allow_pickle=False)


def synthetic_output(width: int, height: int, seed: int, dtype: str = "uint8") -> np.ndarray:
    """What a ``synthetic`` model's worker puts in the arena for ``seed``, computed here."""
    import torch

    from diffusiond.ipc.messages import BatchParams
    from diffusiond.pipelines.synthetic import SyntheticPipeline
    from diffusiond.worker.copier import to_output_layout

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the workers: a computation split otherwise can differ in the last bit
    try:
        pipe = SyntheticPipeline(options={"compute_ms": "0"})
        with torch.inference_mode():
            out = pipe._output(BatchParams(width=width, height=height, steps=1, guidance=1.0), seed)
            return to_output_layout(out, dtype).numpy()
    finally:
        torch.set_num_threads(threads)


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


# 2. large outputs: a stalled reader, a reader that hangs up, results nobody fetches -------------
@pytest.fixture(scope="module")
def big_daemon(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Iterator[Daemon]:
    with shared_daemon(tmp_path_factory.mktemp("big"), [
        "--model", "big=synthetic:compute_ms=5", "--arena-mb", "160", "--retention-s", "4", "--job-timeout", "120",
        "--no-persist",  # the arena and in-memory retention on their own: nothing kept in a state dir
    ], model_cache, ENV) as d:
        yield d


@pytest.fixture
async def big(big_daemon: Daemon) -> Path:
    assert big_daemon.proc is not None and big_daemon.proc.poll() is None, big_daemon.log()
    async with client(big_daemon.socket) as s:
        await until(lambda: idle(s), 60, "the big-output daemon to go idle")
    return big_daemon.socket


async def raw_get(sock: Path, url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
    """GET ``url`` on a connection of our own; returns it with the first bytes of the answer."""
    reader, writer = await asyncio.open_unix_connection(str(sock), limit=64 << 10)
    writer.write(f"GET {url} HTTP/1.1\r\nHost: diffusiond\r\n\r\n".encode())
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    return reader, writer, head


async def fetch_and_check(s: aiohttp.ClientSession, seed: int) -> str:
    """Run a BIG job, fetch its 48 MiB and compare them with the model's output; returns its id."""
    job = await submit(s, {**BIG, "seed": seed})
    done = await finished(s, job["id"], 60)
    assert done["status"] == "succeeded", done
    array = load_npy(await fetch(s, done["outputs"][0]["url"]))
    assert np.array_equal(array, synthetic_output(2048, 2048, seed, "float32")), f"seed {seed}: wrong bytes"
    return str(job["id"])


async def test_a_stalled_reader_blocks_nobody_and_its_slot_comes_back_when_it_goes(big: Path) -> None:
    async with client(big) as s:
        job = await submit(s, {**BIG, "seed": 1})
        done = await finished(s, job["id"], 60)
        reader, writer, head = await raw_get(big, done["outputs"][0]["url"])
        try:
            assert head.startswith(b"HTTP/1.1 200 "), head
            assert len(await reader.readexactly(4096)) == 4096  # a few KB, then the client stops reading
            # other clients keep generating and fetching 48 MiB outputs, bytes checked
            others: list[str] = []
            for seeds in ((10, 11), (12, 13), (14, 15)):
                others += await asyncio.wait_for(asyncio.gather(*(fetch_and_check(s, k) for k in seeds)), 120)

            # every job's retention ends; the stalled one's slot is still being read: held, not reused
            async def only_the_stalled_slot_held() -> bool:
                codes = [(await get(s, f"/v1/jobs/{j}"))[0] for j in [job["id"], *others]]
                return set(codes) == {404} and (await health(s))["arena_bytes_in_use"] == BIG_BYTES

            await until(only_the_stalled_slot_held, 30, "only the stalled reader's slot to be held")
            assert (await health(s))["status"] == "ok"
        finally:
            writer.close()  # the stalled client goes away
        await until(lambda: idle(s), 30, "the stalled reader's slot to come back (arena 0)")
        await fetch_and_check(s, 16)


async def test_readers_that_hang_up_mid_stream_leak_nothing(big: Path) -> None:
    async def hang_up(url: str, times: int) -> None:
        for _ in range(times):  # at different points of the 48 MiB
            reader, writer, head = await raw_get(big, url)
            assert head.startswith(b"HTTP/1.1 200 "), head
            await reader.readexactly(random.randrange(1, 8 * MIB))
            writer.transport.abort()

    async with client(big) as s:
        done = await finished(s, (await submit(s, {**BIG, "seed": 2}))["id"], 60)
        await hang_up(done["outputs"][0]["url"], 3)
        # the output is intact for a reader that stays, and reading it in full gives its slot back
        array = load_npy(await fetch(s, done["outputs"][0]["url"]))
        assert np.array_equal(array, synthetic_output(2048, 2048, 2, "float32"))
        await until(lambda: idle(s), 30, "the slot of the output read in full to come back")
        # one whose readers all hung up comes back when its retention ends: no reader's pin leaked
        other = await finished(s, (await submit(s, {**BIG, "seed": 3}))["id"], 60)
        await hang_up(other["outputs"][0]["url"], 2)
        await until(lambda: idle(s), 30, "the slot to come back at the end of retention (arena 0)")
        assert (await get(s, f"/v1/jobs/{other['id']}"))[0] == 404
        assert (await health(s))["status"] == "ok"
        await fetch_and_check(s, 17)


async def test_results_nobody_fetches_do_not_fill_the_arena_for_good(big: Path) -> None:
    async with client(big) as s:
        # twice as many 48 MiB results as the arena holds, none ever fetched
        jobs = [await submit(s, {**BIG, "seed": 100 + k}) for k in range(6)]
        for job in jobs:
            ended = await finished(s, job["id"], 90)
            assert ended["status"] == "succeeded", ended
        (w,) = (await health(s))["workers"]
        assert w["arena_bytes"] < 4 * BIG_BYTES and w["restarts"] == 0, w
        await until(lambda: idle(s), 30, "the unfetched results' slots to come back (arena 0)")
        await fetch_and_check(s, 18)


# 3. outputs larger than the arena; an arena that is full ---------------------------------------
async def test_outputs_larger_than_the_arena_get_a_dedicated_memfd_with_the_right_bytes(
    daemon_factory: Any,
) -> None:
    d: Daemon = daemon_factory("--model", "big=synthetic:compute_ms=5", "--arena-mb", "1", "--retention-s", "120",
                               "--no-persist",
                               env=ENV)
    assert d.proc is not None
    base = {"model": "big", "prompt": "dedicated", "steps": 2}
    async with client(d.socket) as s:
        (w,) = (await health(s))["workers"]
        assert w["arena_bytes"] == MIB
        npy = await submit(s, {**base, "width": 1024, "height": 1024, "output_format": "npy", "seed": 5, "n": 3})
        f32 = await submit(s, {**base, "width": 512, "height": 512, "output_format": "npy",
                               "output_dtype": "float32", "seed": 6})
        png = await submit(s, {**base, "width": 1024, "height": 1024, "output_format": "png", "seed": 7})
        small = await submit(s, {**base, "width": 64, "height": 64, "output_format": "npy", "seed": 8})
        jobs = {k: await finished(s, j["id"], 60) for k, j in
                (("npy", npy), ("f32", f32), ("png", png), ("small", small))}
        assert all(j["status"] == "succeeded" for j in jobs.values()), jobs
        for k, out in enumerate(jobs["npy"]["outputs"]):
            got = load_npy(await fetch(s, out["url"]))
            assert np.array_equal(got, synthetic_output(1024, 1024, 5 + k)), f"output {k}"
        got = load_npy(await fetch(s, jobs["f32"]["outputs"][0]["url"]))
        assert np.array_equal(got, synthetic_output(512, 512, 6, "float32"))
        from PIL import Image

        image = np.asarray(Image.open(io.BytesIO(await fetch(s, jobs["png"]["outputs"][0]["url"]))))
        assert np.array_equal(image, synthetic_output(1024, 1024, 7))
        got = load_npy(await fetch(s, jobs["small"]["outputs"][0]["url"]))
        assert np.array_equal(got, synthetic_output(64, 64, 8))
        # streamed (or spilled), every dedicated buffer is unmapped and the accounting is back to 0
        await until(lambda: idle(s), 30, "the outputs' memory to be released")
        assert not [line for line in memfd_maps(d.proc.pid) if "diffusiond-output" in line]


async def test_full_arena_fails_the_job_naming_the_sizes_instead_of_hanging(daemon_factory: Any) -> None:
    """An output that does not fit the free part of the arena waits for a slot, then fails with
    the arena's own account of the sizes; a job with a deadline ends at its deadline.

    What holds the arena here is an output a client is still reading (a reader that stalls):
    unfetched outputs no longer fill it (they are spilled once they hold over half of it), but
    an output being streamed is pinned. The wait is ``--slot-timeout-s``, set to 3 s here.
    """
    arena = 8 * MIB
    d: Daemon = daemon_factory("--model", "big=synthetic:compute_ms=5", "--arena-mb", "8", "--retention-s", "600",
                               "--no-persist",
                               "--slot-timeout-s", "3", env=ENV)
    base = {"model": "big", "prompt": "fill", "width": 1024, "steps": 2, "output_format": "npy"}
    held, large = 1024 * 1360 * 3, 1024 * 1400 * 3  # just under half the arena; just over what is left
    assert held <= arena // 2 and large > arena - held
    async with client(d.socket) as s:
        first = await finished(s, (await submit(s, {**base, "height": 1360, "seed": 1}))["id"], 60)
        assert first["status"] == "succeeded", first
        reader, writer, head = await raw_get(d.socket, first["outputs"][0]["url"])
        try:
            assert head.startswith(b"HTTP/1.1 200 "), head
            await reader.readexactly(4096)  # ... and stalls
            assert (await health(s))["arena_bytes_in_use"] == held
            t0 = time.monotonic()
            waiting = await submit(s, {**base, "height": 1400, "seed": 2})
            short = await submit(s, {**base, "height": 1400, "seed": 3, "timeout_s": 2})
            # a job with a deadline ends at its deadline, stuck in copying, not later
            ended = await finished(s, short["id"], 30)
            assert ended["status"] == "failed" and ended["error"]["code"] == "deadline_exceeded", ended
            assert ended["error"]["stage"] == "copying", ended
            # the other waits for a slot, then fails naming the sizes
            failed = await finished(s, waiting["id"], 60)
            assert time.monotonic() - t0 < 50
            assert failed["status"] == "failed", failed
            err = failed["error"]
            assert err["stage"] == "copying" and err["code"] == "generation_failed", err
            assert f"no free slot of {large} bytes after 3.0s" in err["message"], err
            assert f"{held} of {arena} bytes in use in 1 slots" in err["message"], err
            assert f"largest free range {arena - held} bytes" in err["message"], err
            assert "--arena-mb" in err["message"] and "worker 0 (pid " in err["message"], err
            h = await health(s)
            assert h["status"] == "ok" and h["workers"][0]["restarts"] == 0 and h["queue_depth"] == 0, h
            # an output that fits the free part goes through meanwhile
            small = await finished(s, (await submit(s, {**base, "height": 1024, "seed": 4}))["id"], 60)
            assert small["status"] == "succeeded", small
        finally:
            writer.close()
        # once the held output is read in full its slot comes back, and the large output fits
        got = load_npy(await fetch(s, first["outputs"][0]["url"]))
        assert np.array_equal(got, synthetic_output(1024, 1360, 1))
        assert (await finished(s, (await submit(s, {**base, "height": 1400, "seed": 5}))["id"], 60))["status"] \
            == "succeeded"


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
