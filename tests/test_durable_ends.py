"""A job's end against a real daemon: on disk before anyone is told, so a client told "cancelled" or
"done" never meets the job running again after a crash; a failed write of an ending
retried, and named at shutdown when it cannot be; a cancel of a finished job read back from the state
dir is the 409 api.md promises."""

from __future__ import annotations

import asyncio
import signal
import sqlite3
from pathlib import Path
from typing import Any

from daemonkit import cancel, get, http, sigkill, sse, submit, wait_job
from test_durable import BODY, ENV, Factory, serve_args


def rows(state: Path) -> dict[str, str]:
    """Each job's status as the state dir has it (what the next start goes by)."""
    con = sqlite3.connect(state / "jobs.db")
    try:
        return dict(con.execute("SELECT id, status FROM jobs").fetchall())
    finally:
        con.close()


async def test_jobs_answered_cancelled_stay_cancelled_after_a_sigkill(daemon_factory: Factory,
                                                                      tmp_path: Path) -> None:
    """Every DELETE ?finished=keep answered 200 "cancelled", then a SIGKILL at once:
    each job is cancelled on disk and after the restart, none runs. A slow disk (each status write
    held 150 ms) is what left the answers ahead of the writes; the event stream's ``error`` also
    comes only once the row says so."""
    state = tmp_path / "state"
    first = daemon_factory(*serve_args(state, "--state-sync", "full", "--test-fault", "copy_delay_ms=3000",
                                       "--test-state-fault", "update_delay_ms=150"), env=ENV)
    async with http(first.socket) as s:
        jobs = [await submit(s, {**BODY, "prompt": f"gull {i}", "seed": i}) for i in range(8)]
        seen_on_disk: list[str] = []

        async def follow() -> list[tuple[str, dict[str, Any]]]:
            events = await sse(s, jobs[-1]["id"])
            seen_on_disk.append(rows(state)[jobs[-1]["id"]])  # what a crash right now would leave
            return events

        stream = asyncio.ensure_future(follow())
        await asyncio.sleep(0.2)  # subscribed before its cancel
        answers = [await cancel(s, j["id"]) for j in jobs]
        events = await asyncio.wait_for(stream, 30)
    sigkill(first)
    assert [(st, a["status"]) for st, a in answers] == [(200, "cancelled")] * len(jobs), answers
    assert events[-1][0] == "error" and events[-1][1]["status"] == "cancelled", events
    assert seen_on_disk == ["cancelled"], "the stream was told before the state dir had it"
    on_disk = rows(state)
    assert [on_disk[j["id"]] for j in jobs] == ["cancelled"] * len(jobs), on_disk

    second = daemon_factory(*serve_args(state), env=ENV)
    async with http(second.socket) as s:
        after = [(await get(s, f"/v1/jobs/{j['id']}"))[1] for j in jobs]
    assert [a["status"] for a in after] == ["cancelled"] * len(jobs), after
    assert "resuming" not in second.log(), second.log()


async def test_an_ending_a_full_disk_refused_is_written_after_the_next_write_that_succeeds(
        daemon_factory: Factory, tmp_path: Path) -> None:
    """A cancel whose record does not fit is a 507 saying the job is cancelled in this
    run (not a 200 a crash would undo); its stream still ends; once the disk takes writes again (the
    next job's record) the cancel is written too, and a SIGKILL then leaves it cancelled."""
    state = tmp_path / "state"
    full = tmp_path / "disk-is-full"  # while it exists, every write to the state dir fails with ENOSPC
    first = daemon_factory(*serve_args(state, "--test-fault", "copy_delay_ms=3000",
                                       "--test-state-fault", f"enospc_file={full}"), env=ENV)
    async with http(first.socket) as s:
        job = await submit(s, {**BODY, "prompt": "tern"})
        full.touch()
        status, answer = await cancel(s, job["id"])
        assert status == 507 and answer["error"]["code"] == "insufficient_storage", answer
        message = answer["error"]["message"]
        assert str(state) in message and job["id"] in message and "cancelled" in message, message
        assert "restart before that runs it again" in message, message
        events = await asyncio.wait_for(sse(s, job["id"]), 30)
        assert events[-1][0] == "error" and events[-1][1]["status"] == "cancelled", events
        assert rows(state)[job["id"]] in ("queued", "running")
        full.unlink()
        later = await submit(s, {**BODY, "prompt": "tern again"})  # a write that succeeds
        assert rows(state)[job["id"]] == "cancelled"
    sigkill(first)
    assert f"recorded the end of job {job['id']}" in first.log(), first.log()

    second = daemon_factory(*serve_args(state), env=ENV)
    async with http(second.socket) as s:
        assert (await get(s, f"/v1/jobs/{job['id']}"))[1]["status"] == "cancelled"
        assert (await wait_job(s, later["id"], timeout=120))["status"] == "succeeded"


async def test_an_ending_still_unwritten_at_shutdown_is_tried_again_and_else_named(
        daemon_factory: Factory, tmp_path: Path) -> None:
    """at a clean shutdown an unwritten ending is tried once more; a disk still full gets an
    ERROR naming the job the next start runs again (and it does), one with room again keeps the cancel."""
    state = tmp_path / "state"
    full = tmp_path / "disk-is-full"
    args = serve_args(state, "--test-fault", "copy_delay_ms=3000", "--drain-grace-s", "0.5",
                      "--test-state-fault", f"enospc_file={full}")
    first = daemon_factory(*args, env=ENV)
    async with http(first.socket) as s:
        stuck = await submit(s, {**BODY, "prompt": "auk", "seed": 5})
        full.touch()
        assert (await cancel(s, stuck["id"]))[0] == 507
    first.signal(signal.SIGTERM)
    assert await asyncio.to_thread(first.wait, 60) == 0, first.log()
    log = first.log()
    assert "ERROR" in log and f"job(s) {stuck['id']} ended: the next start runs them again" in log, log

    full.unlink()
    second = daemon_factory(*args, env=ENV)
    async with http(second.socket) as s:
        ended = await wait_job(s, stuck["id"], timeout=120)
        assert ended["status"] == "succeeded", ended  # what the ERROR said would happen
        kept = await submit(s, {**BODY, "prompt": "puffin"})
        full.touch()
        assert (await cancel(s, kept["id"]))[0] == 507
        full.unlink()  # room again, and no write until the shutdown's last try
    second.signal(signal.SIGTERM)
    assert await asyncio.to_thread(second.wait, 60) == 0, second.log()
    assert "the next start runs them again" not in second.log(), second.log()
    assert rows(state)[kept["id"]] == "cancelled"


async def test_cancel_of_a_finished_job_no_longer_in_memory_is_409(daemon_factory: Factory,
                                                                   tmp_path: Path) -> None:
    """DELETE ?finished=keep (what `diffusiond cancel` and the clients send) of a job that
    finished and left memory (--retention-s) is 409 job_finished, as of one still in memory, not a 404."""
    d = daemon_factory(*serve_args(tmp_path / "state", "--retention-s", "0.1"), env=ENV)
    async with http(d.socket) as s:
        job = await wait_job(s, (await submit(s, {**BODY, "prompt": "skua"}))["id"])
        assert job["status"] == "succeeded", job
        await asyncio.sleep(0.5)  # out of memory: read back from the state dir
        status, answer = await cancel(s, job["id"])
        assert status == 409 and answer["error"]["code"] == "job_finished", answer
        assert "succeeded" in answer["error"]["message"], answer
        assert (await get(s, f"/v1/jobs/{job['id']}"))[1]["status"] == "succeeded"
        status, answer = await cancel(s, "j_0000000000000000")
        assert status == 404 and answer["error"]["code"] == "job_not_found", answer
