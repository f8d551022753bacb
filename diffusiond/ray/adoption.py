"""A replica's adopted stores: the daemons it runs on the state of replicas that are gone.

An adopted store gets a daemon of its own (``diffusiond serve --state-dir ROOT/<store>``, the
replica's flags, ``--preload none``), not a merge into the replica's daemon: the daemon already
knows how to take back the jobs a dead run left (``core/resume.py``: queued ones queue again,
running ones run again from the start with their seeds), keeps their ids, and serves the
finished ones from its history, so a gone replica's jobs are exactly a crash on one machine.
``--preload none``: it loads only the models its resumed jobs need, when they need them, and
serves finished outputs with none loaded.

Its daemon is started at once for a store with jobs to run again (``claims.scan``, at the
replica's start and with every routing report, and again by the next report when it dies), or when a
request names a store with only finished jobs; it is stopped again once it holds no job and has answered nothing for
``IDLE_STOP_S`` (the claim stays: the next request starts it again), so old stores cost no
worker while no one asks for them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

from diffusiond.protocol import ErrorCode
from diffusiond.ray import claims

log = logging.getLogger("diffusiond.ray")

IDLE_STOP_S = 60.0
MOST_RESTARTS = 3


class Refusal(Exception):
    """A request for a store this replica cannot serve: the status, code and message to answer."""

    def __init__(self, status: int, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


def spawn(args: list[str], socket: Path, log_path: Path, env: dict[str, str], pass_fds: tuple[int, ...],
          preexec: Callable[[], None] | None) -> subprocess.Popen[bytes]:
    """``python -m diffusiond serve --socket SOCKET ARGS``, its output in ``log_path``, holding
    ``pass_fds`` (the store's claim: the lock stays taken while this daemon lives)."""
    with open(log_path, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "diffusiond", "serve", "--socket", str(socket), *args],
                                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                pass_fds=pass_fds, preexec_fn=preexec)


def daemon_load(health: dict[str, Any]) -> int:
    """Jobs a daemon holds, queued plus running, from its ``/health``: what routing and
    autoscaling weigh replicas by (Serve's own count is of calls in flight, and a job submitted
    through ``POST /v1/jobs`` stops being one at its 202)."""
    return int(health.get("queue_depth", 0)) + int((health.get("jobs") or {}).get("running", 0))


def unix_session(socket: Path, current: aiohttp.ClientSession | None) -> aiohttp.ClientSession:
    """``current`` while it is open, else a new session on the daemon's ``socket`` (no total timeout: an
    event stream lasts as long as its job)."""
    if current is not None and not current.closed:
        return current
    return aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(socket), limit=0),
                                 base_url="http://diffusiond",
                                 timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))


def log_tail(path: Path, lines: int = 3) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""


class StoreDaemon:
    """The daemon on one adopted store, started and stopped as requests and jobs need it."""

    def __init__(self, claim: claims.Claim, args: list[str], socket: Path, log_path: Path) -> None:
        self.claim = claim
        self.store = claim.store
        self.args = args
        self.socket = socket
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.stopped = True  # by us (idle), as against exited under us
        self.restarts = 0
        self.used = time.monotonic()
        self.ready = False
        self.inflight = 0  # requests being answered: an idle stop waits for them
        self._session: aiohttp.ClientSession | None = None

    def start(self, env: dict[str, str], preexec: Callable[[], None] | None) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.socket.unlink()
        self.proc = spawn(self.args, self.socket, self.log_path, env, (self.claim.fd,), preexec)
        self.stopped = False
        self.ready = False
        self.used = time.monotonic()

    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def gone_reason(self) -> str | None:
        code = self.exited()
        if code is None or self.stopped:
            return None
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        return f"the daemon on adopted store {self.store} {how}"

    async def wait_ready(self, timeout_s: float) -> str | None:
        """None once it answers ``/ready``, else why not (it exited, with its log's last lines)."""
        deadline = time.monotonic() + timeout_s
        while not self.ready:
            code = self.exited()
            if code is not None:
                return f"its daemon exited with {code} while starting: {log_tail(self.log_path)}"
            if time.monotonic() > deadline:
                return f"its daemon was not ready after {timeout_s:g}s: {log_tail(self.log_path)}"
            with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
                async with self.http().get("/ready", timeout=aiohttp.ClientTimeout(total=5)) as r:
                    self.ready = r.status == 200
            if not self.ready:
                await asyncio.sleep(0.2)
        return None

    def http(self) -> aiohttp.ClientSession:
        self._session = unix_session(self.socket, self._session)
        return self._session

    async def load(self) -> int | None:
        """Jobs it holds, queued plus running: 0 when it is not running, None when it runs and does not
        answer (starting, or too busy to): not known to be idle."""
        if self.exited() is not None or self.proc is None:
            return 0
        try:
            async with self.http().get("/health", timeout=aiohttp.ClientTimeout(total=10)) as r:
                h: dict[str, Any] = await r.json()
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None
        return daemon_load(h)

    def stop(self, timeout_s: float) -> None:
        """SIGTERM and wait: it drains (a job still running is left in its store, as on a restart)."""
        self.stopped = True
        self.ready = False
        proc = self.proc  # a request may start the next process once this one has ended: wait on this one only
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class Adoption:
    """The stores this replica adopted, and how it takes more."""

    def __init__(self, root: Path, me: str, own: str, serve_args: list[str], private: Path, env: dict[str, str],
                 preexec: Callable[[], Callable[[], None]], start_timeout_s: float) -> None:
        self.root = root
        self.me = me  # the replica's Serve id, as markers name adopters
        self.own = own
        self.serve_args = serve_args
        self.private = private
        self.env = env
        self.preexec = preexec
        self.start_timeout_s = start_timeout_s
        self.daemons: dict[str, StoreDaemon] = {}
        self.failed: dict[str, str] = {}
        self._lock = threading.Lock()

    def stores(self) -> list[str]:
        with self._lock:
            return sorted(self.daemons)

    def scan(self) -> list[StoreDaemon]:
        """Adopt the stores of gone replicas that have jobs to run again (blocking file work: the
        replica calls it in a thread); ``start`` their daemons after, from the replica's own thread."""
        with self._lock:
            held = {self.own, *self.daemons}
        taken = claims.scan(self.root, self.me, held)
        for claim in taken:
            log.info("replica %s adopts the jobs of gone replica store %s", self.me, claim.store)
        return [self._take(claim) for claim in taken]

    def start(self, daemons: list[StoreDaemon]) -> None:
        """Start daemons from the thread that lives as long as the replica: the kernel's SIGTERM
        to a daemon (``PR_SET_PDEATHSIG``) comes when the thread that started it ends."""
        for d in daemons:
            d.start(self.env, self.preexec())

    def _take(self, claim: claims.Claim) -> StoreDaemon:
        store = claim.store
        args = [*self.serve_args, "--state-dir", str(self.root / store), "--preload", "none"]
        d = StoreDaemon(claim, args, self.private / f"adopted-{store}.sock", self.private / f"adopted-{store}.log")
        with self._lock:
            self.daemons[store] = d
        return d

    async def daemon_for(self, store: str) -> StoreDaemon:
        """A running daemon on ``store`` for a request that names it, adopting the store now if it
        is free; Refusal with the answer otherwise."""
        if store in self.failed:
            raise Refusal(410, ErrorCode.REPLICA_GONE, self.failed[store])
        with self._lock:
            d = self.daemons.get(store)
        if d is None:
            d = self._adopt_now(store)
        if d.stopped:  # idle, or never started: once an idle stop has finished, start it again
            # a request that came during the stop waits for it; of several, the first starts the daemon and the
            # others see it started (they waited for the old process to end, and now the new one ran till idle)
            while d.stopped and d.proc is not None and d.exited() is None:
                await asyncio.sleep(0.1)
            if d.stopped:
                d.start(self.env, self.preexec())
        elif d.exited() is not None:  # died under us: it resumes its jobs again, a few times
            d.restarts += 1
            if d.restarts > MOST_RESTARTS:
                await self._fail(d, f"its daemon died {MOST_RESTARTS + 1} times: {log_tail(d.log_path)}")
            d.start(self.env, self.preexec())
        d.used = time.monotonic()
        why = await d.wait_ready(self.start_timeout_s)
        if why is not None:
            await self._fail(d, why)
        d.used = time.monotonic()
        return d

    def _adopt_now(self, store: str) -> StoreDaemon:
        if not (self.root / store / claims.LOCK).exists():
            raise Refusal(410, ErrorCode.REPLICA_GONE,
                          f"the job's replica {store} is gone, and the shared state dir has no record of it; "
                          "submit the job again")
        claim = claims.adopt(self.root, store, self.me)
        if claim is None:
            with self._lock:
                if store in self.daemons:  # this replica's own scan took it a moment ago
                    return self.daemons[store]
            marker = claims.read_marker(self.root, store)
            held_by = (f"adopted by replica {marker.by}, which will answer for them" if marker and marker.by != self.me
                       else "still held by its daemon, which is stopping")
            raise Refusal(503, ErrorCode.REPLICA_UNAVAILABLE,
                          f"the job's replica {store} is gone and its jobs are {held_by}: retry in a few seconds")
        log.info("replica %s adopts gone replica store %s for a request", self.me, store)
        return self._take(claim)

    async def _fail(self, d: StoreDaemon, why: str) -> None:
        message = f"the job's replica {d.store} is gone, and replica {self.me} could not open its state: {why}"
        self.failed[d.store] = message
        await asyncio.to_thread(d.stop, 10.0)  # off the loop: every request of this replica waited on it
        with contextlib.suppress(OSError):
            claims.write_marker(self.root, d.store, self.me, failed=message)
        log.warning("%s", message)
        raise Refusal(410, ErrorCode.REPLICA_GONE, message)

    async def tick(self) -> int:
        """With each routing report: adopt what is newly free, start the daemons that should run and do not,
        stop daemons idle for ``IDLE_STOP_S``; returns the jobs the adopted daemons hold (the replica's load
        too)."""
        await asyncio.to_thread(self.scan)
        total = 0
        for d in list(self.daemons.values()):
            if d.store in self.failed:
                continue
            await self._revive(d)
            n = await d.load()
            total += n or 0
            if (n == 0 and d.inflight == 0 and not d.stopped and d.exited() is None
                    and time.monotonic() - d.used > IDLE_STOP_S):
                log.info("replica %s stops the idle daemon of adopted store %s", self.me, d.store)
                await asyncio.to_thread(d.stop, 30.0)
        return total

    async def _revive(self, d: StoreDaemon) -> None:
        """Start ``d`` if its store's jobs have no daemon running them: one claimed by a scan whose tick was
        cancelled before it started (Serve's stats call timed out), or one that died under us. Left to the next
        request, resumed jobs waited for a client to ask; a daemon that keeps dying is given up on."""
        if d.proc is not None and (d.stopped or d.exited() is None):
            return
        if d.proc is not None:
            d.restarts += 1
            if d.restarts > MOST_RESTARTS:
                with contextlib.suppress(Refusal):
                    await self._fail(d, f"its daemon died {MOST_RESTARTS + 1} times: {log_tail(d.log_path)}")
                return
            log.warning("replica %s restarts the daemon of adopted store %s: %s", self.me, d.store, d.gone_reason())
        d.start(self.env, self.preexec())

    def stop_all(self, timeout_s: float) -> None:
        """SIGTERM to every adopted daemon at once (each drains its own grace), then wait for them against one
        deadline: the replica's stop must fit in Serve's graceful shutdown, however many it adopted (each had
        the whole timeout of its own)."""
        deadline = time.monotonic() + timeout_s
        daemons = list(self.daemons.values())
        for d in daemons:
            if d.proc is not None and d.proc.poll() is None:
                d.proc.send_signal(signal.SIGTERM)
        for d in daemons:
            d.stop(max(0.0, deadline - time.monotonic()))
            d.claim.release()

