"""Durable jobs against a real daemon: what was accepted survives a restart and a SIGKILL of the
engine, finished jobs stay fetchable, history pages through them, a full disk is a clear 507,
and a state dir is one daemon's, with a database that is ours or a refusal naming the file."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from daemonkit import Daemon, fill, get, http, sigkill, submit, until, wait_job
from PIL import Image

from conftest import ROOT
from diffusiond.client import Client

BODY = {"model": "tiny", "width": 64, "height": 64, "steps": 2, "output_format": "png"}
ENV = {"OMP_NUM_THREADS": "1"}  # one thread: a seed gives the same bytes in every run
Factory = Callable[..., Daemon]


def serve_args(state: Path, *extra: str) -> list[str]:
    # one output per batch: batch composition then cannot change a single bit of an output
    return ["--model", "tiny", "--state-dir", str(state), "--max-batch", "1", "--job-timeout", "300", *extra]


async def output(s: aiohttp.ClientSession, job: dict[str, Any], k: int = 0) -> bytes:
    async with s.get(f"/v1/jobs/{job['id']}/outputs/{k}") as r:
        assert r.status == 200, await r.text()
        return await r.read()


def files(state: Path) -> list[str]:
    return sorted(os.listdir(state / "outputs"))


# crash and restart ------------------------------------------------------------------------------
STAGES = ["queued", "computing", "copying", "encoding"]


@pytest.mark.parametrize("stage", STAGES)
async def test_sigkill_of_the_engine_then_restart_every_job_succeeds_once_with_its_bytes(
        stage: str, daemon_factory: Factory, tmp_path: Path) -> None:
    state = tmp_path / "state"
    # Copies and output file writes held 1.5 s, so a job can be caught copying or encoding (half
    # of its file written); many steps for a job to be caught computing.
    body = {**BODY, "steps": 40} if stage == "computing" else BODY  # ~1 s a job computing: polled every 50 ms
    first = daemon_factory(*serve_args(state, "--test-fault", "copy_delay_ms=1500",
                                       "--test-state-fault", "write_delay_ms=1500"), env=ENV)
    async with http(first.socket) as s:
        jobs = [await submit(s, {**body, "prompt": f"lighthouse {i}", "seed": 40 + i}) for i in range(4)]

        async def caught() -> list[dict[str, Any]] | None:
            now = [(await get(s, f"/v1/jobs/{j['id']}"))[1] for j in jobs]
            stages = {j["stage"] for j in now}
            started = any(j["status"] == "running" for j in now)
            if stage == "encoding" and not any(n.endswith(".tmp") for n in files(state)):
                return None  # wait for an output file half-way through its write
            return now if stage in stages and (stage != "queued" or started) else None

        seen = await until(caught, 120, f"a job {stage} while others wait")
    sigkill(first)
    left = files(state)
    if stage == "encoding":
        partial = [n for n in left if n.endswith(".tmp")]
        assert partial, left
        writing = [j for j in seen if j["stage"] == "encoding"]
        assert not any(n == f"{j['id']}-0.png" for j in writing for n in left), (writing, left)

    # its copies held 0.5 s, so no output file of a resumed job is being written yet when the files are listed
    second = daemon_factory(*serve_args(state, "--test-fault", "copy_delay_ms=500"), env=ENV)
    assert not any(n.endswith(".tmp") for n in files(state)), "a partial output file survived the restart"
    async with http(second.socket) as s:
        ends = [await wait_job(s, j["id"], timeout=300) for j in jobs]
        assert [e["status"] for e in ends] == ["succeeded"] * 4, ends
        for i, (before, end) in enumerate(zip(seen, ends, strict=True)):
            if before["status"] == "running":  # it had started: it ran again from the start
                assert end["attempts"] == 2, (before, end)
            assert end["outputs"][0]["seed"] == 40 + i
        got = [await output(s, e) for e in ends]
        for data in got:
            Image.open(io.BytesIO(data)).load()  # complete files only
        # the same requests again, on a daemon that never crashed: the same bytes
        again = [await submit(s, {**body, "prompt": f"lighthouse {i}", "seed": 40 + i}) for i in range(4)]
        want = [await output(s, await wait_job(s, j["id"], timeout=300)) for j in again]
        assert got == want
        _, page = await get(s, "/v1/jobs?limit=100")
    ids = [j["id"] for j in page["data"]]
    assert sorted(ids) == sorted({j["id"] for j in jobs + again}), "a job is listed twice or missing"
    assert files(state) == sorted(f"{j['id']}-0.png" for j in jobs + again), "duplicate or stray output files"


async def test_a_synchronous_request_cut_off_by_a_sigkill_ends_at_the_next_start(
        daemon_factory: Factory, tmp_path: Path) -> None:
    """Its caller's connection ended with the daemon: run again, nobody would read it. It fails, saying why."""
    state = tmp_path / "state"
    first = daemon_factory(*serve_args(state, "--test-fault", "copy_delay_ms=3000"), env=ENV)
    async with http(first.socket) as s:
        busy = await submit(s, {**BODY, "prompt": "ahead"})

        async def sync_call() -> None:
            with contextlib.suppress(aiohttp.ClientError):
                async with s.post("/v1/images/generations", json={"model": "tiny", "prompt": "cut off",
                                                                  "size": "64x64", "num_inference_steps": 2}):
                    pass

        call = asyncio.ensure_future(sync_call())

        async def recorded() -> str | None:
            listed = (await get(s, "/v1/jobs?limit=10"))[1]["data"]
            return next((j["id"] for j in listed if j["request"]["prompt"] == "cut off"), None)

        cut = await until(recorded, 60, "the synchronous request's job")
        sigkill(first)
        await asyncio.wait_for(call, 30)
    second = daemon_factory(*serve_args(state), env=ENV)
    async with http(second.socket) as s:
        end = await wait_job(s, cut, timeout=120)
        assert end["status"] == "failed" and end["error"]["code"] == "shutting_down", end
        assert "send the request again" in end["error"]["message"]
        assert (await wait_job(s, busy["id"], timeout=300))["status"] == "succeeded"


async def test_a_clean_shutdown_keeps_unfinished_jobs_for_the_next_start(
        daemon_factory: Factory, tmp_path: Path) -> None:
    """SIGTERM (a restart, a reboot) with jobs that cannot finish within the grace: the async ones
    are not failed but wait in the state dir, their streams told nothing worse than their status,
    and the next start runs them to the bytes they would have had. A synchronous request is
    answered 503 now (its caller would not come back for a result later)."""
    state = tmp_path / "state"
    first = daemon_factory(*serve_args(state, "--test-fault", "copy_delay_ms=3000", "--drain-grace-s", "0.5"),
                           env=ENV)
    async with http(first.socket) as s:
        jobs = [await submit(s, {**BODY, "prompt": f"harbour {i}", "seed": 60 + i}) for i in range(3)]

        async def follow(job_id: str) -> str:
            async with s.get(f"/v1/jobs/{job_id}/events") as r:
                chunks = []
                with contextlib.suppress(aiohttp.ClientError):
                    async for chunk in r.content.iter_any():
                        chunks.append(chunk)
                return b"".join(chunks).decode()

        async def sync_call() -> tuple[int, dict[str, Any]]:
            body = {"model": "tiny", "prompt": "sync", "size": "64x64", "num_inference_steps": 2}
            async with s.post("/v1/images/generations", json=body) as r:
                return r.status, await r.json()

        async def started() -> bool:
            return (await get(s, f"/v1/jobs/{jobs[0]['id']}"))[1]["status"] == "running"

        await until(started, 60, "the first job to start")
        stream = asyncio.ensure_future(follow(jobs[0]["id"]))
        sync = asyncio.ensure_future(sync_call())
        await asyncio.sleep(0.3)  # the synchronous job is queued behind them
        first.signal(signal.SIGTERM)
        assert await asyncio.to_thread(first.wait, 60) == 0, first.log()
        text = await asyncio.wait_for(stream, 30)
        status, answer = await asyncio.wait_for(sync, 30)
    assert "event: error" not in text and "event: status" in text, text
    assert status == 503 and answer["error"]["code"] == "shutting_down", (status, answer)
    assert "stays in the state dir" in first.log()

    second = daemon_factory(*serve_args(state), env=ENV)
    async with http(second.socket) as s:
        ends = [await wait_job(s, j["id"], timeout=300) for j in jobs]
        assert [e["status"] for e in ends] == ["succeeded"] * 3, ends
        # the first had started (it runs again from the start); the others had too if the worker took them
        assert ends[0]["attempts"] == 2 and all(e["attempts"] in (1, 2) for e in ends), ends
        got = [await output(s, e) for e in ends]
        again = [await submit(s, {**BODY, "prompt": f"harbour {i}", "seed": 60 + i}) for i in range(3)]
        want = [await output(s, await wait_job(s, j["id"], timeout=300)) for j in again]
    assert got == want


async def test_finished_jobs_and_their_outputs_outlive_a_restart(daemon_factory: Factory, tmp_path: Path) -> None:
    state = tmp_path / "state"
    first = daemon_factory(*serve_args(state), env=ENV)
    async with http(first.socket) as s:
        png = await wait_job(s, (await submit(s, {**BODY, "prompt": "a fox", "n": 2, "seed": 7}))["id"])
        npy = await wait_job(s, (await submit(s, {**BODY, "prompt": "a fox", "output_format": "npy",
                                                  "seed": 7}))["id"])
        pngs = [await output(s, png, 0), await output(s, png, 1)]
        arr = await output(s, npy)
        assert await output(s, npy) == arr  # on disk: an npy is no longer sent once only
    first.stop()
    assert first.proc is not None and first.proc.returncode == 0, first.log()
    second = daemon_factory(*serve_args(state), env=ENV)
    async with http(second.socket) as s:
        status, again = await get(s, f"/v1/jobs/{png['id']}")
        assert status == 200 and again["status"] == "succeeded" and again["attempts"] == 1, again
        assert [o["url"] for o in again["outputs"]] == [o["url"] for o in png["outputs"]]
        assert [await output(s, png, 0), await output(s, png, 1)] == pngs
        assert await output(s, npy) == arr
        async with s.get(f"/v1/jobs/{png['id']}/events") as r:  # a finished job's stream: its end, at once
            text = await r.text()
        assert "event: done" in text


ROLLOUT = {"scheduler": "ddim", "eta": 1.0, "trajectory": {"latents": True, "log_probs": True}}


async def trajectory_arrays(s: aiohttp.ClientSession, job: dict[str, Any], k: int = 0) -> dict[str, bytes]:
    arrays = {}
    for name, entry in job["outputs"][k]["trajectory"].items():
        async with s.get(entry["url"]) as r:
            assert r.status == 200, await r.text()
            arrays[name] = await r.read()
    return arrays


async def test_a_finished_jobs_trajectory_outlives_a_restart_beside_its_outputs(daemon_factory: Factory,
                                                                                 tmp_path: Path) -> None:
    state = tmp_path / "state"
    first = daemon_factory(*serve_args(state), env=ENV)
    async with http(first.socket) as s:
        job = await wait_job(s, (await submit(s, {**BODY, **ROLLOUT, "prompt": "a fox", "n": 2, "seed": 3}))["id"])
        before = [await trajectory_arrays(s, job, k) for k in range(2)]
    assert f"{job['id']}-1.latents.npy" in files(state)  # an npy file per array, beside the outputs
    first.stop()
    second = daemon_factory(*serve_args(state), env=ENV)
    async with http(second.socket) as s:
        status, again = await get(s, f"/v1/jobs/{job['id']}")
        assert status == 200
        assert [o["trajectory"] for o in again["outputs"]] == [o["trajectory"] for o in job["outputs"]]
        assert [await trajectory_arrays(s, again, k) for k in range(2)] == before  # the same bytes
        with Client(str(second.socket)) as c:  # no shared memory holds them now: the client reads them over HTTP
            mapped = await asyncio.to_thread(c.trajectory, job["id"], 1)
        assert mapped["log_probs"].tobytes() == np.load(io.BytesIO(before[1]["log_probs"])).tobytes()
        async with s.delete(f"/v1/jobs/{job['id']}") as r:
            assert r.status == 200, await r.text()
    assert not [n for n in files(state) if n.startswith(job["id"])], "DELETE left trajectory files behind"


# history ----------------------------------------------------------------------------------------
async def test_history_pages_newest_first_filters_and_delete_removes_record_and_files(
        daemon_factory: Factory, tmp_path: Path) -> None:
    state = tmp_path / "state"
    d = daemon_factory(*serve_args(state), env=ENV)
    async with http(d.socket) as s:
        done = [await wait_job(s, (await submit(s, {**BODY, "prompt": f"p{i}", "seed": i}))["id"]) for i in range(3)]
        held = await submit(s, {**BODY, "prompt": "long", "steps": 400})
        async with s.delete(f"/v1/jobs/{held['id']}") as r:  # not finished: DELETE cancels, as before
            cancelled = await r.json()
        assert r.status == 200 and cancelled["status"] == "cancelled" and cancelled["deleted"] is False
        newest_first = [held["id"], *[j["id"] for j in reversed(done)]]

        _, page1 = await get(s, "/v1/jobs?limit=2")
        assert [j["id"] for j in page1["data"]] == newest_first[:2] and page1["has_more"], page1
        _, page2 = await get(s, f"/v1/jobs?limit=2&before={page1['next_before']}")
        assert [j["id"] for j in page2["data"]] == newest_first[2:] and page2["next_before"] is None, page2
        _, only = await get(s, "/v1/jobs?status=cancelled")
        assert [j["id"] for j in only["data"]] == [held["id"]]
        _, none = await get(s, "/v1/jobs?model=other")
        assert none["data"] == []
        # an unknown cursor is a 400, not an empty page that reads as the end of history
        for query, field in (("status=finished", "status"), ("limit=0", "limit"), ("limit=x", "limit"),
                             ("before=j_doesnotexist", "before")):
            status, err = await get(s, f"/v1/jobs?{query}")
            assert status == 400 and err["error"]["field"] == field, err
            assert query.split("=")[1] in err["error"]["message"]

        gone_job = done[0]
        assert f"{gone_job['id']}-0.png" in files(state)
        async with s.delete(f"/v1/jobs/{gone_job['id']}") as r:
            deleted = await r.json()
        assert r.status == 200 and deleted["deleted"] is True, deleted
        assert f"{gone_job['id']}-0.png" not in files(state)
        for path in (f"/v1/jobs/{gone_job['id']}", f"/v1/jobs/{gone_job['id']}/outputs/0"):
            status, err = await get(s, path)
            assert status == 404 and err["error"]["code"] == "job_not_found", err
        status, err = await get(s, f"/v1/jobs?before={gone_job['id']}")
        assert (status, err["error"]["field"]) == (400, "before") and "deleted" in err["error"]["message"], err

    out = subprocess.run([sys.executable, "-m", "diffusiond", "history", "--socket", str(d.socket)],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split()[:4] == ["id", "created", "model", "status"]
    assert [line.split()[0] for line in lines[1:]] == newest_first[:3]
    assert "cancelled" in lines[1] and "(cancelled)" not in lines[1] and "succeeded" in lines[2]  # no code twice
    out = subprocess.run([sys.executable, "-m", "diffusiond", "history", "--json", "--limit", "1", "--status",
                          "succeeded", "--socket", str(d.socket)], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    page = json.loads(out.stdout)
    assert [j["id"] for j in page["data"]] == [done[2]["id"]] and page["next_before"] == done[2]["id"]

    out = subprocess.run([sys.executable, "-m", "diffusiond", "status", "--socket", str(d.socket)],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr  # its first run: history holds only its own jobs
    assert "jobs in memory: " in out.stdout and "`diffusiond history` lists more" not in out.stdout, out.stdout

    d.stop()
    again = daemon_factory(*serve_args(state), env=ENV)
    async with http(again.socket) as s:
        _, page = await get(s, "/v1/jobs")
    assert [j["id"] for j in page["data"]] == newest_first[:3], "history after a restart"
    out = subprocess.run([sys.executable, "-m", "diffusiond", "status", "--socket", str(again.socket)],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr  # the restarted daemon holds no job of its own, history does
    assert "jobs in memory: none; `diffusiond history` lists more" in out.stdout, out.stdout


async def test_status_in_one_run_says_its_counts_are_the_jobs_in_memory(daemon_factory: Factory,
                                                                        tmp_path: Path) -> None:
    """a finished job leaves memory after --retention-s, so /health's counts go down within one run;
    status said "jobs in this run" and "history keeps earlier ones" on a first run, where there was no earlier."""
    d = daemon_factory(*serve_args(tmp_path / "state", "--retention-s", "1"), env=ENV)
    async with http(d.socket) as s:
        await wait_job(s, (await submit(s, {**BODY, "prompt": "kept"}))["id"])

        async def left_memory() -> bool:
            return not any((await get(s, "/health"))[1]["jobs"].values())

        await until(left_memory, 60, "the finished job leaving memory after --retention-s 1")
    out = subprocess.run([sys.executable, "-m", "diffusiond", "status", "--socket", str(d.socket)],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "jobs in memory: none; `diffusiond history` lists more (a finished job leaves memory after serve's " \
           "--retention-s" in out.stdout, out.stdout
    assert "this run" not in out.stdout and "earlier" not in out.stdout, out.stdout


async def test_retention_deletes_old_finished_jobs_and_their_files(daemon_factory: Factory, tmp_path: Path) -> None:
    state = tmp_path / "state"
    # keep finished jobs 3 seconds (0.0000347 days), looked at every 0.3 s
    d = daemon_factory(*serve_args(state, "--keep-days", "0.0000347", "--retention-check-s", "0.3"), env=ENV)
    async with http(d.socket) as s:
        job = await wait_job(s, (await submit(s, {**BODY, "prompt": "old"}))["id"])
        assert files(state) == [f"{job['id']}-0.png"]

        async def deleted() -> bool:
            return (await get(s, f"/v1/jobs/{job['id']}"))[0] == 404

        await until(deleted, 60, "retention to delete the job")
        assert files(state) == []
        fresh = await wait_job(s, (await submit(s, {**BODY, "prompt": "new"}))["id"])
        assert await output(s, fresh)  # a new job is not touched before its time


# starting ---------------------------------------------------------------------------------------
async def test_jobs_are_accepted_while_the_models_load(daemon_factory: Factory, tmp_path: Path) -> None:
    state = tmp_path / "state"
    daemon_factory(*serve_args(state), env=ENV).stop()  # the model has loaded once here: its defaults are known
    slow = daemon_factory(*serve_args(state, "--test-fault", "load_delay_ms=6000"), env=ENV, start=False)
    slow.spawn()
    deadline = time.monotonic() + 60
    while not slow.socket.exists():
        assert time.monotonic() < deadline and slow.proc is not None and slow.proc.poll() is None, slow.log()
        await asyncio.sleep(0.001)
    async with http(slow.socket) as s:
        # sent at once, so it mostly comes while the start still recovers the state dir: admitted as admission
        # opens, before the preload's first step. Its dispatch used to load tiny itself, the preload then skipped
        # tiny ("stays on disk at start: tiny is loading") and /ready said done with nothing loaded
        async with s.post("/v1/jobs", json={"prompt": "early", "seed": 3}) as r:
            job = await r.json()
        assert r.status == 202 and job["status"] == "queued" and job["stage"] == "loading", job
        # /ready means admitting (issue 27): 200 while the preload still loads the model, and it says so
        ready = await until(lambda: _ready(s), 60, "/ready to answer 200")
        assert ready["preload"] == {"state": "running", "models": ["tiny"]}, ready
        assert (await get(s, "/health"))[1]["preload"]["state"] == "running"
        async with s.post("/v1/images/generations", json={"prompt": "early too"}) as r:  # waits for its result
            assert r.status == 200, await r.text()
            sync = await r.json()
        assert len(sync["data"]) == 1
        done = await wait_job(s, job["id"])
    assert done["status"] == "succeeded" and done["request"]["width"] == 128, done  # tiny's own default size
    assert slow.ready() == {"ready": True, "preload": {"state": "done", "models": []}}
    assert "stays on disk at start" not in slow.log_path.read_text(), slow.log()


async def _ready(s: aiohttp.ClientSession) -> dict[str, Any] | None:
    status, body = await get(s, "/ready")
    return body if status == 200 else None


# refusals at start ----------------------------------------------------------------------------
def refused(d: Daemon) -> str:
    d.spawn()
    assert d.proc is not None
    assert d.proc.wait(120) == 1, d.log()
    return d.log()


async def test_a_second_daemon_on_the_same_state_dir_refuses_naming_the_first(
        daemon_factory: Factory, tmp_path: Path) -> None:
    state = tmp_path / "state"
    first = daemon_factory(*serve_args(state), env=ENV)
    assert first.proc is not None
    log = refused(daemon_factory(*serve_args(state), env=ENV, start=False))
    assert f"{state} is in use by another diffusiond (pid {first.proc.pid})" in log
    # the journal must not read as a start that served: only the one that locked the dir says it
    assert "listening on" not in log and "listening on" in first.log(), log
    async with http(first.socket) as s:  # the first one is untouched
        assert (await wait_job(s, (await submit(s, {**BODY, "prompt": "x"}))["id"]))["status"] == "succeeded"


@pytest.mark.parametrize("kind", ["random bytes", "another program's database"])
def test_a_corrupt_or_foreign_database_stops_the_start_until_reset(
        kind: str, daemon_factory: Factory, tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    db = state / "jobs.db"
    if kind == "random bytes":
        db.write_bytes(os.urandom(16384))
    else:
        con = sqlite3.connect(db)
        con.execute("CREATE TABLE photos (id INTEGER PRIMARY KEY, path TEXT)")
        con.commit()
        con.close()
    before = db.read_bytes()
    log = refused(daemon_factory(*serve_args(state), env=ENV, start=False))
    assert f"{db} is not a diffusiond state database" in log and "--reset-state" in log, log
    assert "Traceback" not in log
    assert db.read_bytes() == before, "the file was changed without --reset-state"
    daemon_factory(*serve_args(state, "--reset-state"), env=ENV)
    aside = [p for p in state.iterdir() if p.name.startswith("jobs.db.bad-")]
    assert len(aside) == 1 and aside[0].read_bytes() == before


# a full disk ------------------------------------------------------------------------------------
async def test_a_full_disk_fails_new_jobs_with_507_naming_the_state_dir(daemon_factory: Factory,
                                                                        tmp_path: Path) -> None:
    state = tmp_path / "state"
    full = tmp_path / "disk-is-full"  # while it exists, every write to the state dir fails with ENOSPC
    d = daemon_factory(*serve_args(state, "--test-fault", "copy_delay_ms=1000",
                                   "--test-state-fault", f"enospc_file={full}"), env=ENV)
    async with http(d.socket) as s:
        full.touch()
        for path, body in (("/v1/jobs", {**BODY, "prompt": "a"}), ("/v1/images/generations", {"prompt": "a"})):
            async with s.post(path, json=body) as r:
                err = (await r.json())["error"]
            assert r.status == 507 and err["code"] == "insufficient_storage", err
            assert str(state) in err["message"] and "full" in err["message"], err
        full.unlink()
        job = await submit(s, {**BODY, "prompt": "b"})  # recorded; its output file comes >1 s later
        full.touch()
        ended = await wait_job(s, job["id"])
        assert ended["status"] == "failed" and ended["error"]["code"] == "insufficient_storage", ended
        assert str(state) in ended["error"]["message"] and ended["error"]["stage"] == "encoding"
        full.unlink()
        ok = await wait_job(s, (await submit(s, {**BODY, "prompt": "c"}))["id"])
        assert ok["status"] == "succeeded"
        _, page = await get(s, "/v1/jobs")
    assert [(j["id"], j["status"]) for j in page["data"]] == [(ok["id"], "succeeded"), (job["id"], "failed")]
    assert files(state) == [f"{ok['id']}-0.png"]


async def test_a_full_tmpfs_state_dir(daemon_factory: Factory, tmp_path: Path) -> None:
    """The same on a real filesystem that fills up: a 4 MiB tmpfs mounted for the test."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {(r.stderr or r.stdout).strip()}")
    try:
        state = mnt / "state"
        d = daemon_factory(*serve_args(state), env=ENV)
        async with http(d.socket) as s:
            first = await wait_job(s, (await submit(s, {**BODY, "prompt": "fits"}))["id"])
            assert first["status"] == "succeeded"
            fill(mnt / "filler")
            async with s.post("/v1/jobs", json={**BODY, "prompt": "no room"}) as resp:
                answer = await resp.json()
            if resp.status == 507:  # the record itself did not fit
                err = answer["error"]
            else:  # the record fit in the database's free pages; the output file did not
                assert resp.status == 202, answer
                ended = await wait_job(s, answer["id"])
                assert ended["status"] == "failed", ended
                err = ended["error"]
            assert err["code"] == "insufficient_storage" and str(state) in err["message"], err
            (mnt / "filler").unlink()
            later = await wait_job(s, (await submit(s, {**BODY, "prompt": "room again"}))["id"])
            assert later["status"] == "succeeded"
            assert await output(s, first) and await output(s, later)
        d.stop()
        con = sqlite3.connect(state / "jobs.db")
        assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        con.close()
        assert not [n for n in files(state) if n.endswith(".tmp")]
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


# in memory only -------------------------------------------------------------------------------
async def test_no_persist_keeps_nothing_on_disk(daemon_factory: Factory, tmp_path: Path) -> None:
    state = tmp_path / "state"
    d = daemon_factory("--model", "tiny", "--no-persist", "--state-dir", str(state), env=ENV)
    async with http(d.socket) as s:
        job = await wait_job(s, (await submit(s, {**BODY, "prompt": "x"}))["id"])
        traj = await wait_job(s, (await submit(s, {**BODY, **ROLLOUT, "prompt": "x"}))["id"])
        assert (await trajectory_arrays(s, traj)).keys() == {"latents", "log_probs", "timesteps", "sigmas"}
        _, page = await get(s, "/v1/jobs")
        assert [j["id"] for j in page["data"]] == [traj["id"], job["id"]]
    assert not state.exists()  # the trajectory too lived in memory only
