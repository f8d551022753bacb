"""Adopted stores at their edges, without Ray: real daemons on ``tiny`` and real flocks on a shared state dir.

A store no replica can open must not stop the others being adopted; requests that come while an idle daemon
stops must all get the daemon started again; and a gone replica's jobs must run without anyone asking for
them, even when the daemon running them was never started (its scan's tick was cut short) or died."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path

import pytest
from adoptkit import SERVE_ARGS, env, ready, replicas_daemon
from daemonkit import http, until

from diffusiond.ray import adoption, claims

JOB = {"model": "tiny", "width": 64, "height": 64, "prompt": "kept", "seed": 3}


def adopter(root: Path, private: Path, me: str = "adopter1") -> adoption.Adoption:
    private.mkdir(parents=True, exist_ok=True)
    return adoption.Adoption(root, me, me, SERVE_ARGS, private, env(), lambda: (lambda: None), 120.0)


async def succeeded(d: adoption.StoreDaemon, job: str) -> bool:
    try:
        async with d.http().get(f"/v1/jobs/{job}") as r:
            return bool((await r.json())["status"] == "succeeded")
    except (OSError, ValueError, KeyError):
        return False


def test_a_store_no_replica_can_open_is_skipped_and_the_others_are_adopted(tmp_path: Path) -> None:
    """An OSError other than a held lock (permissions, a bad volume) escaped the scan: every replica failed at
    its start, and every routing report after."""
    bad, good = tmp_path / "bad00001", tmp_path / "good0001"
    (bad / claims.LOCK).mkdir(parents=True)  # the lock cannot be opened
    (bad / claims.DB).write_bytes(b"not a database")
    good.mkdir()
    (good / claims.DB).write_bytes(b"not a database")  # unreadable: it may hold jobs, so it is adopted
    claims.claim_own(tmp_path, "good0001").release()
    taken = claims.scan(tmp_path, "adopter1", set())
    try:
        assert [c.store for c in taken] == ["good0001"]
    finally:
        for c in taken:
            c.release()


async def test_requests_that_come_while_an_idle_daemon_stops_all_get_it_started_again(
        model_cache: Path, tmp_path: Path) -> None:
    """Both waited for the old process to end; the first started the next, and the second then waited for that
    one to end too (its idle stop, a minute on, or never)."""
    root = tmp_path / "shared"
    claims.claim_own(root, "gone0001").release()
    a = adopter(root, tmp_path / "p")
    try:
        d = await a.daemon_for("gone0001")
        stopping = asyncio.create_task(asyncio.to_thread(d.stop, 30.0))
        await until(lambda: asyncio.sleep(0, d.stopped), timeout=10, what="the idle stop begun")
        first, second = await asyncio.wait_for(
            asyncio.gather(a.daemon_for("gone0001"), a.daemon_for("gone0001")), 120)
        await stopping
        assert first is second is d and not d.stopped and d.exited() is None
        assert await ready(d.socket)
    finally:
        a.stop_all(30.0)


async def test_a_gone_replicas_jobs_run_with_no_one_asking_though_their_daemon_never_started_or_died(
        model_cache: Path, tmp_path: Path) -> None:
    root, owner, sock, proc = replicas_daemon(tmp_path)
    try:
        await until(lambda: ready(sock), timeout=120, what="the first daemon ready")
        async with http(sock) as s:
            async with s.post("/v1/admin/sleep") as r:  # the job stays queued till its replica is gone
                assert r.status == 200, await r.text()
            async with s.post("/v1/jobs", json={**JOB, "steps": 2}) as r:
                job = (await r.json())["id"]
    finally:
        proc.send_signal(signal.SIGKILL)  # the node is lost: no drain
        proc.wait()
        owner.release()

    a = adopter(root, tmp_path / "p")
    try:
        [d] = a.scan()  # a scan claimed the store, and its tick was cancelled before it started a daemon there
        assert d.proc is None
        await a.tick()
        first = d.proc
        assert first is not None and d.exited() is None, "the next tick starts the daemon that runs the store's jobs"
        assert await d.wait_ready(120) is None
        first.send_signal(signal.SIGKILL)  # died under its adopter
        first.wait()
        await a.tick()
        assert d.proc is not first and d.exited() is None, "the next tick starts it again"
        assert await d.wait_ready(120) is None
        await until(lambda: succeeded(d, job), timeout=120, what="the adopted job finished, with no request for it")
    finally:
        a.stop_all(30.0)


async def test_an_adopted_daemon_that_does_not_answer_its_health_check_is_not_stopped_as_idle(
        model_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed ``/health`` read as no jobs, so a daemon too busy to answer it in time was stopped as idle."""
    root = tmp_path / "shared"
    claims.claim_own(root, "gone0001").release()
    a = adopter(root, tmp_path / "p")
    try:
        d = await a.daemon_for("gone0001")
        assert d.proc is not None
        monkeypatch.setattr(adoption, "IDLE_STOP_S", 0.0)
        os.kill(d.proc.pid, signal.SIGSTOP)  # running, and answering nothing
        try:
            await a.tick()
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(d.proc.pid, signal.SIGCONT)
        assert not d.stopped and d.exited() is None
    finally:
        a.stop_all(30.0)
