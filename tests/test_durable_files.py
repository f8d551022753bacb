"""The state dir's output files against a real daemon: no file outlives what lists it (a job
cancelled while its file is written, a job read back from its row, a file no row names at start), a file damaged
outside diffusiond is an error naming it rather than a short 200, and --keep-days counts from a job's end."""

from __future__ import annotations

import asyncio
from pathlib import Path

from daemonkit import get, http, submit, until, wait_job
from test_durable import BODY, ENV, Factory, files, serve_args


async def test_a_job_cancelled_while_its_file_is_written_leaves_no_file(daemon_factory: Factory,
                                                                        tmp_path: Path) -> None:
    """Its record was written at the cancel with no outputs: a file renamed into place after it would be listed
    nowhere, and neither DELETE nor retention nor --keep-gb would ever see it."""
    state = tmp_path / "state"
    d = daemon_factory(*serve_args(state, "--test-state-fault", "write_delay_ms=3000"), env=ENV)
    async with http(d.socket) as s:
        job = await submit(s, {**BODY, "prompt": "cut short"})

        async def writing() -> bool:
            return any(n.endswith(".tmp") for n in files(state))

        await until(writing, 120, "the output file to be half-way written")
        async with s.delete(f"/v1/jobs/{job['id']}?finished=keep") as r:
            cancelled = await r.json()
        assert r.status == 200 and cancelled["status"] == "cancelled", cancelled

        async def empty() -> bool:
            return not files(state)

        await until(empty, 30, "the file written for the cancelled job to be removed")
        _, now = await get(s, f"/v1/jobs/{job['id']}")
        assert now["status"] == "cancelled" and now["outputs"] == [], now
        # a job after it is untouched
        ok = await wait_job(s, (await submit(s, {**BODY, "prompt": "whole"}))["id"])
        assert ok["status"] == "succeeded" and files(state) == [f"{ok['id']}-0.png"], (ok, files(state))


async def test_delete_after_a_restart_removes_the_files_of_a_job_that_failed_half_way(
        daemon_factory: Factory, tmp_path: Path) -> None:
    """Output 0 of an n=2 job is written, output 1 meets a full disk: the job fails. Read back from its row after a
    restart, the job knows no file (only a succeeded job's are served), yet DELETE removes output 0's."""
    state = tmp_path / "state"
    full = tmp_path / "disk-is-full"
    first = daemon_factory(*serve_args(state, "--test-fault", "copy_delay_ms=1500",
                                       "--test-state-fault", f"enospc_file={full}"), env=ENV)
    async with http(first.socket) as s:
        job = await submit(s, {**BODY, "prompt": "half", "n": 2})

        async def first_written() -> bool:
            return f"{job['id']}-0.png" in files(state)

        await until(first_written, 120, "output 0's file")
        full.touch()
        ended = await wait_job(s, job["id"])
        assert ended["status"] == "failed" and ended["error"]["code"] == "insufficient_storage", ended
    full.unlink()  # room again before the stop: the failure's own record, refused by the full disk, is written then
    first.stop()
    assert files(state) == [f"{job['id']}-0.png"]

    second = daemon_factory(*serve_args(state), env=ENV)
    assert files(state) == [f"{job['id']}-0.png"], "the start removed a file its failed job's record lists"
    async with http(second.socket) as s:
        async with s.delete(f"/v1/jobs/{job['id']}") as r:
            deleted = await r.json()
        assert r.status == 200 and deleted["deleted"] is True, deleted
    assert files(state) == [], "DELETE left the job's file behind"


async def test_files_no_finished_job_lists_are_removed_at_start(daemon_factory: Factory, tmp_path: Path) -> None:
    """Files of no job (a row deleted while its file was written, an older diffusiond's cancel) and files a
    finished job's row does not list go at start, with a count in the log; listed ones and foreign names stay."""
    state = tmp_path / "state"
    first = daemon_factory(*serve_args(state), env=ENV)
    async with http(first.socket) as s:
        job = await wait_job(s, (await submit(s, {**BODY, "prompt": "kept"}))["id"])
        assert job["status"] == "succeeded"
    first.stop()
    kept = f"{job['id']}-0.png"
    data = (state / "outputs" / kept).read_bytes()
    planted = ["j_00000000000000ab-0.png", "j_00000000000000ab-0.latents.npy", f"{job['id']}-1.png"]
    for name in planted:
        (state / "outputs" / name).write_bytes(b"stray")
    (state / "outputs" / "notes.txt").write_text("not ours")

    second = daemon_factory(*serve_args(state), env=ENV)
    assert files(state) == [kept, "notes.txt"], files(state)
    assert f"removed {len(planted)} file(s) from {state / 'outputs'}" in second.log(), second.log()
    async with http(second.socket) as s, s.get(f"/v1/jobs/{job['id']}/outputs/0") as r:
        assert r.status == 200 and await r.read() == data


async def test_a_damaged_output_file_is_an_error_naming_it_not_a_short_200(daemon_factory: Factory,
                                                                           tmp_path: Path) -> None:
    state = tmp_path / "state"
    d = daemon_factory(*serve_args(state), env=ENV)
    async with http(d.socket) as s:
        body = {**BODY, "prompt": "damaged", "scheduler": "ddim", "eta": 1.0, "trajectory": {"latents": True}}
        job = await wait_job(s, (await submit(s, body))["id"])
        assert job["status"] == "succeeded", job
        path = state / "outputs" / f"{job['id']}-0.png"
        whole = path.read_bytes()
        for damage in (whole[: len(whole) // 2], b'{"x":1}'):
            path.write_bytes(damage)
            async with s.get(f"/v1/jobs/{job['id']}/outputs/0") as r:
                err = (await r.json())["error"]
            assert r.status == 500 and err["code"] == "state_failed", err
            assert str(path) in err["message"] and f"not the {len(whole)}" in err["message"], err
        assert f"{path} (output 0 of job {job['id']}) has 7 bytes" in d.log()
        path.write_bytes(whole)  # restored: served again
        async with s.get(f"/v1/jobs/{job['id']}/outputs/0") as r:
            assert r.status == 200 and await r.read() == whole

        latents = state / "outputs" / f"{job['id']}-0.latents.npy"
        latents.write_bytes(latents.read_bytes()[:-4])
        d.stop()  # restarted: the trajectory is no longer in shared memory, only in its file
    again = daemon_factory(*serve_args(state), env=ENV)
    async with http(again.socket) as s:
        async with s.get(job["outputs"][0]["trajectory"]["latents"]["url"]) as r:
            err = (await r.json())["error"]
        assert r.status == 500 and err["code"] == "state_failed" and str(latents) in err["message"], err


async def test_keep_days_counts_from_the_jobs_end(daemon_factory: Factory, tmp_path: Path) -> None:
    """A job that took longer than --keep-days to finish is kept that long after it finished, not deleted at
    once: kept 4 s (0.0000463 days), its copy alone held 6 s."""
    state = tmp_path / "state"
    d = daemon_factory(*serve_args(state, "--keep-days", "0.0000463", "--retention-check-s", "0.3",
                                   "--test-fault", "copy_delay_ms=6000"), env=ENV)
    async with http(d.socket) as s:
        job = await wait_job(s, (await submit(s, {**BODY, "prompt": "slow"}))["id"])
        assert job["status"] == "succeeded", job
        await asyncio.sleep(1.5)  # five retention passes: the old rule (from creation, 6 s ago) had deleted it
        status, again = await get(s, f"/v1/jobs/{job['id']}")
        assert status == 200 and again["status"] == "succeeded", again
        async with s.get(f"/v1/jobs/{job['id']}/outputs/0") as r:
            assert r.status == 200

        async def deleted() -> bool:  # a 404 comes as the delete starts (nobody reads it then), its files go after
            return (await get(s, f"/v1/jobs/{job['id']}"))[0] == 404 and files(state) == []

        await until(deleted, 60, "retention to delete the job and its files once 4 s past its end")
