"""Faults on the worker channel and in the worker, against a real daemon.

Frames are tampered with on the wire by the worker's test-only fault injector (``--test-fault``,
off in normal runs, applied to the first worker only so its replacement is healthy). Every case
must end the affected job with a reason naming the worker and what happened, replace the worker,
and let the next job succeed: nothing waits for a frame that will never come.
"""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

import pytest
from daemonkit import http, in_stage, wait_job

from conftest import shm_entries

FAST = {"prompt": "a fox", "width": 64, "height": 64, "steps": 2, "seed": 1}


async def _health(session: Any) -> dict[str, Any]:
    async with session.get("/health") as r:
        return await r.json()


async def _replaced(session: Any, old_pid: int, timeout: float = 60) -> dict[str, Any]:
    async def poll() -> dict[str, Any]:
        while True:
            h = await _health(session)
            w = h["workers"][0]
            if w["pid"] != old_pid and w["state"] == "ready":
                return w
            await asyncio.sleep(0.1)

    return await asyncio.wait_for(poll(), timeout)


async def _submit(session: Any, body: dict[str, Any]) -> str:
    async with session.post("/v1/jobs", json=body) as r:
        assert r.status == 202, await r.text()
        return (await r.json())["id"]


@pytest.mark.parametrize(
    ("fault", "words"),
    [
        ("drop_frame=OUTPUT_READY", "gap (frames lost)"),
        ("dup_frame=COMPUTE_DONE", "repeated or reordered"),
        ("corrupt_frame=OUTPUT_READY", "checksum mismatch"),
    ],
    ids=["dropped", "repeated", "corrupted"],
)
async def test_channel_fault_fails_job_with_reason_and_replaces_worker(daemon_factory, fault: str, words: str) -> None:  # type: ignore[no-untyped-def]
    before = shm_entries()
    d = daemon_factory("--model", "tiny", "--test-fault", fault, "--job-timeout", "300")
    async with http(d.socket) as s:
        old = (await _health(s))["workers"][0]["pid"]
        job = await wait_job(s, await _submit(s, FAST), timeout=60)
        assert job["status"] == "failed"
        err = job["error"]
        assert err["code"] == "worker_lost", err  # not a deadline: detected, not waited out
        assert "protocol error" in err["message"] and words in err["message"] and f"pid {old}" in err["message"]
        w = await _replaced(s, old)
        assert w["restarts"] == 1
        again = await wait_job(s, await _submit(s, FAST), timeout=60)
        assert again["status"] == "succeeded", again
    assert shm_entries() == before


async def test_worker_killed_mid_copy_fails_job_in_copying_stage(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    d = daemon_factory("--model", "tiny", "--test-fault", "copy_delay_ms=3000")
    async with http(d.socket) as s:
        pid = (await _health(s))["workers"][0]["pid"]
        job_id = await _submit(s, FAST)
        await in_stage(s, job_id, "copying")
        os.kill(pid, signal.SIGKILL)
        job = await wait_job(s, job_id, timeout=60)
        assert job["status"] == "failed" and job["error"]["stage"] == "copying"
        assert "SIGKILL" in job["error"]["message"] and f"pid {pid}" in job["error"]["message"]
        await _replaced(s, pid)
        assert (await wait_job(s, await _submit(s, FAST)))["status"] == "succeeded"


async def test_worker_dying_in_copy_thread_fails_job_with_exit_code(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    d = daemon_factory("--model", "tiny", "--test-fault", "exit_in_copy")
    async with http(d.socket) as s:
        pid = (await _health(s))["workers"][0]["pid"]
        job = await wait_job(s, await _submit(s, FAST), timeout=60)
        assert job["status"] == "failed" and "exited with code 3" in job["error"]["message"]
        await _replaced(s, pid)
        assert (await wait_job(s, await _submit(s, FAST)))["status"] == "succeeded"


async def test_worker_killed_while_idle_is_replaced_and_no_job_is_touched(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    d = daemon_factory("--model", "tiny", "--workers", "2")
    async with http(d.socket) as s:
        done = await wait_job(s, await _submit(s, FAST))
        pids = [w["pid"] for w in (await _health(s))["workers"]]
        os.kill(pids[0], signal.SIGKILL)

        async def replaced() -> list[int]:
            while True:
                ws = (await _health(s))["workers"]
                if pids[0] not in [w["pid"] for w in ws] and all(w["state"] == "ready" for w in ws):
                    return [w["pid"] for w in ws]
                await asyncio.sleep(0.1)

        now = await asyncio.wait_for(replaced(), 60)
        assert pids[1] in now  # the other worker was not touched
        async with s.get(f"/v1/jobs/{done['id']}") as r:
            assert (await r.json())["status"] == "succeeded"  # a finished job stays finished
        async with s.get(f"/v1/jobs/{done['id']}/outputs/0") as r:
            assert r.status == 200 and (await r.read()).startswith(b"\x89PNG")
        assert (await wait_job(s, await _submit(s, FAST)))["status"] == "succeeded"


async def test_failing_restarts_back_off_without_duplicating_workers(daemon_factory, model_cache, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The replacement of a dead worker cannot load its model (the folder went away): the
    daemon tries again with growing back-off (up to ``REPLACE_ATTEMPTS``), never runs two
    replacements at once, and recovers once the model is back."""
    import shutil

    from diffusiond.pipelines.tiny import ensure_tiny

    folder = tmp_path / "mymodel"
    shutil.copytree(ensure_tiny(model_cache), folder)
    d = daemon_factory("--model", f"m={folder}")
    async with http(d.socket) as s:
        pid = (await _health(s))["workers"][0]["pid"]
        shutil.move(folder, tmp_path / "away")
        os.kill(pid, signal.SIGKILL)

        async def failures(n: int) -> None:
            while d.log().count("replacing m's worker on cpu failed") < n:
                await asyncio.sleep(0.1)

        await asyncio.wait_for(failures(2), 60)
        h = await _health(s)
        assert len(h["workers"]) == 1 and h["workers"][0]["state"] == "dead", h
        assert len(d.worker_pids()) <= 1  # at most the one replacement being tried
        shutil.move(tmp_path / "away", folder)
        job = await wait_job(s, await _submit(s, {**FAST, "model": "m"}), timeout=90)  # accepted: one is on its way
        if job["status"] == "failed":  # a try begun before the folder came back failed: the job was told why
            assert job["error"]["code"] == "model_load_failed", job
            assert "its replacement did not start" in job["error"]["message"], job
            job = await wait_job(s, await _submit(s, {**FAST, "model": "m"}), timeout=90)
        assert job["status"] == "succeeded", job
        assert (await _health(s))["workers"][0]["state"] == "ready"
