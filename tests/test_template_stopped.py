"""A worker template that stops answering (SIGSTOP, a cgroup freezer, a debugger), on a real daemon.

Its forked workers' ends were seen only through its EXITED: with it stopped, a worker killed under it stayed
``ready`` for good, the next job sent the engine into a loop that never yielded (``Flights.dispatch`` picked that
worker again and again), and the daemon's stop waited for good on a worker it had stopped. Now each forked worker's
pidfd is watched from its fork on; the template, which no longer reports, is killed, and workers start fresh.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from daemonkit import Daemon, gone, http, shared_daemon, wait_job
from enginekit import Harness

from diffusiond.ipc.errors import ChannelClosed
from diffusiond.protocol import WorkerState

FAST = {"prompt": "a fox", "width": 64, "height": 64, "steps": 2, "seed": 1}
ARGS = ["--model", "tiny", "--preload", "tiny", "--preimport", "on", "--no-persist"]
# systemd's socket activation, naming fds of the engine's only (LISTEN_PID is not the daemon's: it ignores them)
LISTEN = {"LISTEN_FDS": "1", "LISTEN_PID": "1", "LISTEN_FDNAMES": "x"}


@contextlib.contextmanager
def _daemon(tmp: Path, model_cache: Path) -> Iterator[Daemon]:
    with shared_daemon(tmp, ARGS, model_cache, env=LISTEN) as d:
        template = d.template_pid()
        assert template is not None
        try:
            yield d
        finally:  # whatever the test did to it, nothing stays stopped behind the daemon
            with contextlib.suppress(ProcessLookupError):
                os.kill(template, signal.SIGCONT)


async def _worker(s: Any, other_than: int = 0) -> dict[str, Any]:
    while True:
        async with s.get("/health") as r:
            (w,) = (await r.json())["workers"]
        if w["pid"] != other_than and w["state"] == "ready":
            return w  # type: ignore[no-any-return]
        await asyncio.sleep(0.1)


def _environ(pid: int) -> set[str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return {v.split(b"=", 1)[0].decode() for v in f.read().split(b"\0") if v}


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


async def test_a_worker_killed_under_a_stopped_template_is_lost_and_replaced(
        tmp_path: Path, model_cache: Path) -> None:
    with _daemon(tmp_path, model_cache) as d:
        template = d.template_pid()
        assert template is not None and d.proc is not None
        async with http(d.socket) as s:
            pid = (await _worker(s))["pid"]
            assert _parent(pid) == template
            # neither the template nor its forks inherit fds they do not have
            assert not set(LISTEN) & (_environ(template) | _environ(pid))
            os.kill(template, signal.SIGSTOP)
            os.kill(pid, signal.SIGKILL)
            new = (await asyncio.wait_for(_worker(s, other_than=pid), 60))["pid"]  # was: `ready` with the dead pid
            assert _parent(new) == d.proc.pid  # started fresh: the template no longer answers
            async with s.post("/v1/jobs", json=FAST) as r:
                assert r.status == 202, await r.text()
                job_id = (await r.json())["id"]
            job = await wait_job(s, job_id, timeout=60)
            assert job["status"] == "succeeded", job  # was: the engine spun for good on the dead worker
        assert gone(template)  # killed, and reaped
        why = f"it did not report the end of worker pid {pid} within 3s"
        log = d.log()
        assert f"worker 0 (pid {pid}, cpu) ended; its exit status is unknown (its worker template stopped: {why})" \
            in log, log
        assert f"the worker template (pid {template}) stopped forking workers: {why}; workers start as fresh " \
            "interpreters from now on" in log, log


async def test_the_daemon_stops_with_its_template_stopped(tmp_path: Path, model_cache: Path) -> None:
    with _daemon(tmp_path, model_cache) as d:
        template = d.template_pid()
        assert template is not None
        (pid,) = d.worker_pids()
        os.kill(template, signal.SIGSTOP)
        d.signal(signal.SIGTERM)
        assert await asyncio.to_thread(d.wait, 60) == 0  # was: waited for good on the worker it had stopped
        assert gone(template)  # killed and reaped by the engine
        for _ in range(500):  # its ended worker, once the template's, is init's to reap now
            if gone(pid):
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError(f"worker {pid} outlived the daemon")


async def test_dispatch_leaves_out_a_worker_it_could_not_send_to() -> None:
    """A READY worker whose channel had closed failed each send, its batch went back to the queue's
    head, and the same pass picked the same worker again, for ever, never yielding to the loop that would reap
    it. The handle now leaves READY as its channel closes; dispatch, should a send fail anyway, leaves that
    worker out for the rest of its pass."""
    h = Harness()
    await h.engine.start()
    try:
        worker = h.worker
        sent = 0

        def closed(*_: Any) -> None:
            nonlocal sent
            sent += 1
            if sent >= 50:
                worker.state = WorkerState.DEAD  # ends the loop where it would not end by itself
            raise ChannelClosed(f"{worker.name} is not connected (its channel closed)")

        worker.execute = closed  # type: ignore[method-assign]
        job = h.submit()  # dispatched at once: one try on that worker (was: 50, until this test's stop)
        assert sent == 1
        h.engine.dispatch()  # and one on each later pass
        assert sent == 2
        await h.settle()
        assert worker.state == WorkerState.READY and not job.terminal  # it waits for a worker that takes it
    finally:
        await h.close()
