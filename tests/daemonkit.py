"""Run a real daemon for end-to-end tests: ``diffusiond serve`` in a subprocess on a temporary
Unix socket, with real workers, and an aiohttp client over that socket."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from conftest import ROOT


@contextlib.contextmanager
def shared_daemon(tmp: Path, args: list[str], model_cache: Path, env: dict[str, str] | None = None) -> Iterator[Daemon]:
    """A started daemon in ``tmp`` (socket d.sock, log d.log) for a module-scoped fixture."""
    d = Daemon(tmp / "d.sock", args, tmp / "d.log", env={"DIFFUSIOND_CACHE": str(model_cache), **(env or {})})
    try:
        d.start()
        yield d
    finally:
        d.stop()


def gone(pid: int) -> bool:
    """The process no longer exists (reaped or never was)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


class Daemon:
    def __init__(self, socket_path: Path, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.socket = socket_path
        # each daemon its own state dir beside its socket (two daemons on one dir refuse to run)
        if not {"--state-dir", "--no-persist"} & set(args):
            args = [*args, "--state-dir", str(socket_path.with_suffix(".state"))]
        self.state_dir = Path(args[args.index("--state-dir") + 1]) if "--state-dir" in args else None
        self.args = args
        self.log_path = log_path
        self.env = env or {}
        self.proc: subprocess.Popen[bytes] | None = None

    def spawn(self) -> None:
        """Start the process and return at once (``start`` also waits until it is ready)."""
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self.env)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "diffusiond", "serve", "--socket", str(self.socket), *self.args],
            stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
        )

    def start(self, timeout: float = 120, *, loaded: bool = True) -> None:
        """Spawn and wait until ``/ready`` answers 200 (admitting) and, with ``loaded`` (most tests assume the
        models are on their devices once the daemon is up), until the start's preload is done too (issue 27)."""
        self.spawn()
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.log()}")
            ready = self.ready() if self.socket.exists() else None
            if ready is not None and (not loaded or ready["preload"]["state"] == "done"):
                return
            time.sleep(0.1)
        raise TimeoutError(f"daemon not ready after {timeout}s:\n{self.log()}")

    def ready(self) -> dict[str, Any] | None:
        """``/ready``'s body when it answers 200, else None (not up yet, starting or draining)."""
        import socket as s

        try:
            with s.socket(s.AF_UNIX, s.SOCK_STREAM) as c:
                c.settimeout(2)
                c.connect(str(self.socket))
                c.sendall(b"GET /ready HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                data = b""
                while chunk := c.recv(4096):
                    data += chunk
        except OSError:
            return None
        head, _, body = data.partition(b"\r\n\r\n")
        if b" 200 " not in head.split(b"\r\n", 1)[0]:
            return None
        return dict(json.loads(body))

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-6000:]
        except FileNotFoundError:
            return ""

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 60) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        with contextlib.suppress(Exception):
            self._log.close()

    def worker_pids(self) -> list[int]:
        """The daemon's workers, from /proc: its children, and the children of its worker template (issue 27),
        which forks them."""
        assert self.proc is not None
        template = self.template_pid()
        return [p for p in _children(self.proc.pid) if p != template] + (_children(template) if template else [])

    def template_pid(self) -> int | None:
        """The worker template's pid (``--preimport``), None when the daemon has none."""
        assert self.proc is not None
        return next((p for p in _children(self.proc.pid) if "diffusiond.worker.template" in _cmdline(p)), None)


def _children(pid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        pids.append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return pids


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def sigkill(d: Daemon) -> None:
    """Kill the engine process the way a crash would; its workers follow (channel EOF)."""
    assert d.proc is not None
    workers = d.worker_pids()
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait(30)
    deadline = time.monotonic() + 30
    while not all(gone(p) for p in workers):
        assert time.monotonic() < deadline, f"workers {workers} outlived their engine"
        time.sleep(0.05)


@contextlib.asynccontextmanager
async def http(socket_path: Path, *, limit: int = 100) -> AsyncIterator[aiohttp.ClientSession]:
    """An aiohttp session over the daemon's socket; ``limit=0`` lifts the connection cap (tests
    that keep many streams open at once)."""
    conn = aiohttp.UnixConnector(path=str(socket_path), limit=limit)
    async with aiohttp.ClientSession(connector=conn, base_url="http://diffusiond") as session:
        yield session


async def sse(session: aiohttp.ClientSession, job_id: str) -> list[tuple[str, dict[str, Any]]]:
    """All events of a job's stream until done/error."""
    events: list[tuple[str, dict[str, Any]]] = []
    async with session.get(f"/v1/jobs/{job_id}/events") as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        name = None
        async for raw in resp.content:
            line = raw.decode().rstrip("\n")
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: ") and name:
                events.append((name, json.loads(line[6:])))
                if name in ("done", "error"):
                    return events
    return events


async def wait_job(session: aiohttp.ClientSession, job_id: str, timeout: float = 120) -> dict[str, Any]:
    async def poll() -> dict[str, Any]:
        while True:
            async with session.get(f"/v1/jobs/{job_id}") as r:
                job = await r.json()
            if job["status"] in ("succeeded", "failed", "cancelled"):
                return job
            await asyncio.sleep(0.05)

    return await asyncio.wait_for(poll(), timeout)


# small request helpers shared by the end-to-end tests ---------------------------------------
async def in_stage(s: Any, job_id: str, stage: str, timeout: float = 60) -> None:
    """Wait until job ``job_id`` is in ``stage`` (``copying``: where a fault test kills its worker)."""

    async def there() -> bool:
        async with s.get(f"/v1/jobs/{job_id}") as r:
            return bool((await r.json())["stage"] == stage)

    await until(there, timeout, f"job {job_id} to reach {stage}")


async def until(check: Callable[[], Awaitable[Any]], timeout: float, what: str) -> Any:
    """Poll ``check`` until it returns something truthy; fail naming ``what`` after ``timeout``."""

    async def poll() -> Any:
        while True:
            result = await check()
            if result:
                return result
            await asyncio.sleep(0.05)

    try:
        return await asyncio.wait_for(poll(), timeout)
    except TimeoutError:
        pytest.fail(f"timed out after {timeout:g}s waiting for {what}")


async def get(s: aiohttp.ClientSession, path: str) -> tuple[int, dict[str, Any]]:
    async with s.get(path) as r:
        return r.status, await r.json()


async def submit(s: aiohttp.ClientSession, body: dict[str, Any]) -> dict[str, Any]:
    async with s.post("/v1/jobs", json=body) as r:
        job = await r.json()
        assert r.status == 202, job
        return job


async def first_output(s: aiohttp.ClientSession, body: dict[str, Any]) -> bytes:
    """Submit ``body``, wait for it to succeed, and return its first output's bytes."""
    job = await wait_job(s, (await submit(s, body))["id"])
    assert job["status"] == "succeeded", job
    async with s.get(job["outputs"][0]["url"]) as r:
        assert r.status == 200
        return await r.read()


def fds_named(pid: int, *names: str) -> list[str]:
    """What process ``pid``'s open file descriptors point at, of those whose target names one of ``names``
    (a memfd is ``/memfd:NAME (deleted)``): a test that a buffer is closed once its job is over."""
    links = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            links.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return [x for x in links if any(n in x for n in names)]


async def delete(s: aiohttp.ClientSession, job_id: str) -> tuple[int, dict[str, Any]]:
    async with s.delete(f"/v1/jobs/{job_id}") as r:
        return r.status, await r.json()


async def cancel(s: aiohttp.ClientSession, job_id: str) -> tuple[int, dict[str, Any]]:
    """DELETE that only cancels (``?finished=keep``): 409 for a finished job, which a plain DELETE deletes."""
    async with s.delete(f"/v1/jobs/{job_id}?finished=keep") as r:
        return r.status, await r.json()


async def health(s: aiohttp.ClientSession) -> dict[str, Any]:
    return (await get(s, "/health"))[1]


async def idle(s: aiohttp.ClientSession) -> bool:
    h = await health(s)
    return (
        h["queue_depth"] == 0
        and h["arena_bytes_in_use"] == 0
        and h["jobs"]["queued"] == 0
        and h["jobs"]["running"] == 0
        and all(w["batches_in_flight"] == 0 for w in h["workers"])
    )


async def when_idle(d: Daemon) -> Path:
    """A shared daemon's socket once it is idle (nothing queued or in flight, no slot held), so
    each test using a module-wide daemon starts clean."""
    assert d.proc is not None and d.proc.poll() is None, d.log()
    async with http(d.socket) as s:
        await until(lambda: idle(s), 60, "the shared daemon to go idle")
    return d.socket


def fill(path: Path) -> None:
    """Write ``path`` until its disk is full (a small tmpfs the test mounted), to the last byte."""
    with open(path, "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    with contextlib.suppress(OSError), open(path, "ab") as f:  # the last partial page, byte by byte
        while True:
            f.write(b"\0")
            f.flush()
