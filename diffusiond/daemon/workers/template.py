"""The engine's end of the worker template (issue 27's cold start; the process is ``worker/template.py``).

A worker started as a fresh interpreter spends seconds importing torch, diffusers and transformers before it
reads a byte of its model (~13 s on an H100 host), on every start: the first model, each model loaded on demand
after it left for disk, each restart after a crash. The template does those imports once, as the daemon starts,
and forks each worker from there (gunicorn's ``preload_app``, Android's zygote).

``spawn`` starts it as ``diffusiond serve`` begins, so its imports and the daemon's start go on side by side;
the pool ``claim``s it. ``Template.fork`` hands it a worker's channel socket and gets back a ``ForkedProcess``, the
part of ``asyncio.subprocess.Process`` that ``WorkerHandle`` uses. Whenever the template cannot serve (it said
it is unusable, it died, a fork request went unanswered, it did not report a child's end) ``fork`` returns None,
the reason is logged once, and the handle spawns this and every later worker as a fresh interpreter, as without
it; a fork the template refuses (FORKED with an error) is logged each time and only that worker starts fresh.
Nothing waiting on a worker start is lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable

import msgspec

from diffusiond.daemon.config import DaemonConfig
from diffusiond.ipc.template import MAX_MESSAGE, Exited, Fork, Forked, Status, decode_reply, encode, socketpair
from diffusiond.pipelines.spec import loads_libraries

log = logging.getLogger(__name__)

FORK_TIMEOUT_S = 30.0  # a fork answers in milliseconds; past this the template is wedged
# A template's imports take seconds (~13 s on an H100 host): one still importing after this is hung, and waiting
# the worker's whole start timeout (900 s by default) for it cost the first start all of it.
IMPORTS_TIMEOUT_S = 180.0
# The template reports a child's end (EXITED) in milliseconds once the child's pidfd says it ended: past this it
# is not answering (stopped, frozen, wedged), and the child's end is taken from its pidfd alone.
EXIT_GRACE_S = 3.0


def enabled(preimport: str, device: str) -> bool:
    """``auto`` forks the workers of the device kinds a forked worker has run on: CPU, and CUDA since
    tests/test_gpu_template.py passed on an H100 (issue 27, 2026-12-06); ``on`` forks every worker."""
    return preimport == "on" or (preimport == "auto" and device.split(":")[0] in ("cpu", "cuda"))


def unknown_exit(why: str) -> str:
    """A forked worker's end when its template can no longer say how it ended (one sentence)."""
    return f"ended; its exit status is unknown (its worker template stopped: {why})"


class ForkedProcess:
    """A worker the template forked: its pid, its exit, ``kill`` and ``wait``.

    A pidfd names the process itself, so ``kill`` never hits a reused pid. The template opens it right after its
    fork, before it can have reaped the child, and sends it with FORKED (issue 27: one opened here, later, could
    miss a child that had already exited, or name another process). It is watched from then on: its end is seen
    there whether or not the template reports it (a stopped template sent no EXITED, so a dead
    worker was never reaped, reported lost or replaced, and the daemon's stop waited for it for good). Its status
    comes from the template's EXITED when that follows within ``EXIT_GRACE_S``; else it is unknown, and
    ``unreported`` breaks the template, which no longer answers. None where the kernel has no pidfds (kill by pid;
    a kill that brings no EXITED within the grace is taken as done).
    """

    def __init__(self, pid: int, pidfd: int | None, unreported: Callable[[str], None] | None = None) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self.exit_note = ""
        self._done = asyncio.Event()
        self._pidfd = pidfd
        self._watching = False
        self._unreported = unreported
        self._orphaned: Callable[[], str] | None = None  # the template is gone: why, for an end seen on the pidfd
        self._grace: asyncio.TimerHandle | None = None
        if pidfd is not None:
            asyncio.get_running_loop().add_reader(pidfd, self._ended)
            self._watching = True

    def kill(self) -> None:
        if self.returncode is not None:
            return
        if self._pidfd is not None:
            signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            return
        os.kill(self.pid, signal.SIGKILL)
        if self._orphaned is not None:
            self.exited(255, unknown_exit(self._orphaned()))
        elif self._grace is None:  # no pidfd to see the end: a template that does not report it is not answering
            self._grace = asyncio.get_running_loop().call_later(EXIT_GRACE_S, self._not_reported)

    async def wait(self) -> int:
        await self._done.wait()
        assert self.returncode is not None
        return self.returncode

    def exited(self, returncode: int, note: str = "") -> None:
        if self.returncode is not None:
            return
        self.returncode, self.exit_note = returncode, note
        if self._grace is not None:
            self._grace.cancel()
        self._unwatch()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
        self._done.set()

    def orphan(self, why: Callable[[], str]) -> None:
        """The template broke: this worker runs on, and its end is seen on its pidfd, its status unknown (``why``
        is read then: the template's reason may be more precise by then, a signal in place of "it died")."""
        self._orphaned = why
        if self._pidfd is None or self._grace is not None:  # no end to watch for; or it ended, and no EXITED comes
            self.exited(255, unknown_exit(why()))

    def _unwatch(self) -> None:
        if self._watching and self._pidfd is not None:
            self._watching = False
            with contextlib.suppress(RuntimeError):  # the loop closed before this process ended
                asyncio.get_running_loop().remove_reader(self._pidfd)

    def _ended(self) -> None:
        """Its pidfd says the process ended: EXITED says how, unless the template no longer can."""
        self._unwatch()
        if self._orphaned is not None:
            self.exited(255, unknown_exit(self._orphaned()))
        elif self.returncode is None and self._grace is None:
            self._grace = asyncio.get_running_loop().call_later(EXIT_GRACE_S, self._not_reported)

    def _not_reported(self) -> None:
        why = f"it did not report the end of worker pid {self.pid} within {EXIT_GRACE_S:g}s"
        self.exited(255, unknown_exit(why))
        if self._unreported is not None:
            self._unreported(why)


class Template:
    def __init__(self, proc: subprocess.Popen[bytes], sock: socket.socket, preimport: str) -> None:
        self.proc = proc
        self.sock = sock
        self.preimport = preimport
        self.children: dict[int, ForkedProcess] = {}
        self.broken: str | None = None  # why it no longer forks; logged once
        self._status: asyncio.Future[Status] | None = None
        self._replies: dict[int, asyncio.Future[ForkedProcess | str]] = {}
        self._seq = 0
        self._lock: asyncio.Lock | None = None
        self._reaper: asyncio.Future[None] | None = None

    def serves(self, device: str) -> bool:
        return self.broken is None and enabled(self.preimport, device)

    async def fork(self, env: dict[str, str], log_level: str, fd: int, timeout: float) -> ForkedProcess | None:
        """A worker on ``fd`` forked from the template, or None (the reason logged once) to spawn it directly.

        ``timeout`` is the worker's start timeout. A hung template must not spend it all, or the fresh interpreter
        started in its place has none left: its imports get at most ``IMPORTS_TIMEOUT_S``, and the
        fork at most what is left of ``timeout``; the caller gives the fresh interpreter a timeout of its own."""
        if self.broken is not None:
            return None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        self.attach()
        assert self._status is not None and self._lock is not None
        imports = min(timeout, IMPORTS_TIMEOUT_S)
        try:
            status = await asyncio.wait_for(asyncio.shield(self._status), imports)
        except TimeoutError:
            self._break(f"its imports did not finish within {imports:g}s")
            return None
        except ConnectionError as exc:
            self._break(str(exc))
            return None
        if not status.ready:
            self._break(f"it is unusable: {status.why}")
            return None
        async with self._lock:  # one FORK at a time: its fd and its answer go together
            self._seq += 1
            reply: asyncio.Future[ForkedProcess | str] = loop.create_future()
            self._replies[self._seq] = reply
            wait = max(0.0, min(FORK_TIMEOUT_S, deadline - loop.time()))
            try:
                socket.send_fds(self.sock, [encode(Fork(self._seq, env, log_level))], [fd])
                forked = await asyncio.wait_for(reply, wait)
            except TimeoutError:  # str(TimeoutError()) is empty: the message says what timed out
                self._break(f"it did not answer a fork request within {wait:.1f}s")
                return None
            except OSError as exc:
                self._break(f"a fork request failed: {type(exc).__name__}: {exc}")
                return None
            finally:
                self._replies.pop(self._seq, None)
        if isinstance(forked, str):
            log.warning("the worker template could not fork (%s); this worker starts as a fresh interpreter",
                        forked)
            return None
        return forked

    def attach(self) -> None:
        """Read the template from now on, on the running loop: its status, its death and its reaping are handled
        whether or not a worker is ever forked (attached at the first fork only, a template that
        died or was unusable before it stayed <defunct>, unlogged, until then)."""
        if self._status is not None or self.sock.fileno() < 0:
            return
        loop = asyncio.get_running_loop()
        self._status, self._lock = loop.create_future(), asyncio.Lock()
        # a break fails it with no fork awaiting it (none yet, or one that gave up): read, or asyncio logs it
        self._status.add_done_callback(lambda f: f.cancelled() or f.exception())
        self.sock.setblocking(False)
        loop.add_reader(self.sock.fileno(), self._readable)

    def _readable(self) -> None:
        fds: list[int] = []
        try:
            data, fds, _, _ = socket.recv_fds(self.sock, MAX_MESSAGE, 1)
        except BlockingIOError:
            return
        except OSError as exc:
            data, why = b"", f"it died ({exc})"
        else:
            why = "it died" if not data else ""
        if not data:
            self._break(why, gone=True)
            return
        try:
            msg = decode_reply(data)
        except msgspec.DecodeError as exc:
            for fd in fds:
                os.close(fd)
            self._break(f"it sent an unreadable message: {exc}")
            return
        if isinstance(msg, Forked) and msg.pid:
            self._forked(msg, fds[0] if fds else None)
            return
        for fd in fds:
            os.close(fd)
        if isinstance(msg, Status):
            if self._status is not None and not self._status.done():
                self._status.set_result(msg)
            if not msg.ready:  # broken here, not at the next fork: its EOF, right behind, said only "it died"
                self._break(f"it is unusable: {msg.why}", gone=True)  # it exits on its own
        elif isinstance(msg, Forked):
            fut = self._replies.get(msg.seq)
            if fut is not None and not fut.done():
                fut.set_result(msg.error or "it answered with no pid")
        elif isinstance(msg, Exited):
            child = self.children.pop(msg.pid, None)
            if child is not None:
                child.exited(msg.returncode)

    def _forked(self, msg: Forked, pidfd: int | None) -> None:
        """Registered here, as FORKED is read, so an EXITED right behind it finds its child (issue 27: when it was
        registered as ``fork`` resumed, a loop hop later, a child that died at once was never seen to end)."""
        child = self.children[msg.pid] = ForkedProcess(msg.pid, pidfd, self._break)
        fut = self._replies.get(msg.seq)
        if fut is not None and not fut.done():
            fut.set_result(child)
            return
        log.warning("the worker template forked pid %d for a start that no longer waits; killing it", msg.pid)
        with contextlib.suppress(ProcessLookupError):
            child.kill()  # its EXITED still comes, and reaps it from ``children``

    def _break(self, why: str, *, gone: bool = False) -> None:
        """Stop forking from it, say why once, and let its children run on without it."""
        first = self.broken is None
        self.broken = self.broken or why
        self._close_socket()
        if self._status is not None and not self._status.done():
            self._status.set_exception(ConnectionError(why))
        for fut in self._replies.values():
            if not fut.done():
                fut.set_exception(ConnectionError(why))
        for child in self.children.values():
            child.orphan(lambda: self.broken or why)
        self.children.clear()
        if not gone and self.proc.poll() is None:
            self.proc.kill()  # a template that no longer answers forks nothing again
        if first:  # reaped in a thread, not here: this runs in the engine's reader callbacks
            self._reaper = asyncio.ensure_future(self._reap(why, gone))

    async def _reap(self, why: str, gone: bool) -> None:
        """The template reaped (no <defunct> for the daemon's life), then why it broke logged, with its signal."""
        rc = await asyncio.to_thread(self._wait)
        if gone and rc < 0 and why.startswith("it died"):  # a signal says more; a reason it gave says more still
            why = self.broken = f"it {describe_exit(rc)}"
        log.warning("the worker template (pid %d) stopped forking workers: %s; workers start as fresh "
                    "interpreters from now on", self.proc.pid, why)

    def _wait(self) -> int:
        try:
            return self.proc.wait(5)  # its socket closed as it exited, or it was killed: a moment away
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def _close_socket(self) -> None:
        if self.sock.fileno() < 0:
            return
        if self._status is not None:
            with contextlib.suppress(RuntimeError):
                asyncio.get_running_loop().remove_reader(self.sock.fileno())
        self.sock.close()

    async def close(self) -> None:
        """The daemon stops: EOF on its socket ends the template; SIGKILL if it lingers."""
        self.broken = self.broken or "the daemon stopped"
        for child in self.children.values():  # none should be left; any that is, is no longer watched
            child.orphan(lambda: "the daemon stopped")
        self.children.clear()
        self._close_socket()
        if self._reaper is not None:
            await self._reaper
            return
        if self._status is None or not self._status.done():
            self.proc.kill()  # still importing, EOF unread until the imports end: nothing of it to keep
        try:
            await asyncio.to_thread(self.proc.wait, 5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            await asyncio.to_thread(self.proc.wait)


def describe_exit(returncode: int | None) -> str:
    """How a process (a worker, the template) ended, for a sentence that names it first. A signal with no name
    here (a real-time one, 35) is given by its number: naming it raised, in the task that reaps the template."""
    if returncode is None:
        return "is still running"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = str(-returncode)
        return f"was killed by signal {name}"
    return f"exited with code {returncode}"


_SPAWNED: Template | None = None


def spawn(config: DaemonConfig) -> None:
    """Start the template for this daemon, if any worker of ``config`` is to be forked (``--preimport``).

    Called by ``server.serve`` before the event loop starts, so the template's imports overlap the daemon's own
    start; a failure to start it is logged and workers start as fresh interpreters."""
    global _SPAWNED
    if not any(enabled(config.preimport, d) for m in config.models for d in m.devices):
        return
    libraries = any(loads_libraries(m.spec) for m in config.models)
    compiler = any(m.compile and loads_libraries(m.spec) for m in config.models)  # issue 31: ~1 s a worker
    mine, theirs = socketpair()
    argv = [sys.executable, "-m", "diffusiond.worker.template", "--fd", str(theirs.fileno()),
            "--log-level", config.log_level.upper(), *(["--libraries"] if libraries else []),
            *(["--compiler"] if compiler else [])]
    # systemd's socket activation describes the engine's fds, not the template's or its children's; and
    # a spawned worker never sees them either: systemd.listen_fds pops them, but only after this spawn
    env = {k: v for k, v in os.environ.items() if k not in ("LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES")}
    try:
        proc = subprocess.Popen(argv, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env)
    except OSError as exc:
        log.warning("the worker template did not start (%s); workers start as fresh interpreters", exc)
        mine.close()
        return
    finally:
        theirs.close()
    _SPAWNED = Template(proc, mine, config.preimport)


def claim() -> Template | None:
    """The template ``spawn`` started, handed over once (to the pool of this process's daemon, built on the
    running loop), and read from then on (``Template.attach``)."""
    global _SPAWNED
    template, _SPAWNED = _SPAWNED, None
    if template is not None:
        with contextlib.suppress(RuntimeError):  # no running loop: attached at its first fork instead
            template.attach()
    return template
