"""The worker template's faults (issue 27's cold start), against a fake template on a socketpair.

The engine's end (``daemon/workers/template.py``) talks to a coroutine that answers as the template would, so a
child that exits at once, an unusable template, a failed fork and a template dying mid-fork are each one script;
where the fallback matters, the real ``WorkerHandle`` then starts a fresh interpreter (a synthetic model) and
runs a job on it.
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Callable

import pytest
from workerkit import Driver, config

import diffusiond.ipc.messages as m
from diffusiond.daemon.workers.handle import WorkerHandle
from diffusiond.daemon.workers.link import WorkerStartError
from diffusiond.daemon.workers.template import ForkedProcess, Template
from diffusiond.ipc.template import MAX_MESSAGE, Exited, Fork, Forked, Status, decode_request, encode, socketpair

PARAMS = m.BatchParams(width=32, height=32, steps=2, guidance=1.0)
Script = Callable[["Fake", Fork], None]


class Fake:
    """The template's side of the socketpair: says ``status``, then answers each FORK with ``script``."""

    def __init__(self, status: Status, script: Script) -> None:
        self.script = script
        self.kept: list[socket.socket] | None = None  # the channels received, where a test keeps them open
        mine, self.sock = socketpair()
        self.stand_in = subprocess.Popen(["sleep", "60"])  # the process the engine kills when it breaks
        self.template = Template(self.stand_in, mine, "on")
        self.sock.setblocking(False)
        self.send(status)
        asyncio.get_running_loop().add_reader(self.sock.fileno(), self._readable)

    def send(self, *msgs: Forked | Exited | Status, pidfd: int | None = None) -> None:
        for i, msg in enumerate(msgs):
            socket.send_fds(self.sock, [encode(msg)], [pidfd] if pidfd is not None and i == 0 else [])

    def _readable(self) -> None:
        try:
            data, fds, _, _ = socket.recv_fds(self.sock, MAX_MESSAGE, 4)
        except OSError:
            data, fds = b"", []
        for fd in fds:  # the worker's channel: this fake runs no worker on it
            if self.kept is None:
                os.close(fd)
            else:
                self.kept.append(socket.socket(fileno=fd))
        if not data:
            self.close()
            return
        self.script(self, decode_request(data))

    def close(self) -> None:
        if self.sock.fileno() >= 0:
            asyncio.get_running_loop().remove_reader(self.sock.fileno())
            self.sock.close()

    async def stop(self) -> None:
        self.close()
        self.stand_in.kill()
        await self.template.close()


@pytest.fixture
async def fake_of() -> AsyncIterator[Callable[[Status, Script], Fake]]:
    fakes: list[Fake] = []

    def make(status: Status, script: Script) -> Fake:
        fakes.append(Fake(status, script))
        return fakes[-1]

    yield make
    for fake in fakes:
        await fake.stop()


def _exits_at_once(fake: Fake, fork: Fork) -> None:
    """A child that ends right after its fork: FORKED and its EXITED reach the engine in one read."""
    child = subprocess.Popen(["sh", "-c", "exit 3"])
    pidfd = os.pidfd_open(child.pid)  # before the reap, as the template opens it
    child.wait()
    fake.send(Forked(fork.seq, pid=child.pid), Exited(child.pid, 3), pidfd=pidfd)
    os.close(pidfd)


async def test_a_forked_child_that_exits_at_once_fails_the_start_with_its_exit(fake_of) -> None:  # type: ignore[no-untyped-def]
    fake = fake_of(Status(True, pid=1), _exits_at_once)
    channel = os.open(os.devnull, os.O_RDONLY)
    proc = await fake.template.fork({}, "INFO", channel, 30)
    os.close(channel)
    assert isinstance(proc, ForkedProcess)
    assert await asyncio.wait_for(proc.wait(), 10) == 3  # its exit is seen, not lost behind the fork's reply
    # and a worker start on such a child fails at once with that exit, not after its start timeout
    handle = WorkerHandle(config("synthetic:compute_ms=1"), on_frame=lambda *_: None, on_lost=lambda *_: None,
                          template=fake.template)
    with pytest.raises(WorkerStartError, match=r"worker 0 \(pid \d+, cpu\) exited with code 3"):
        await asyncio.wait_for(handle.start(timeout=600), 20)
    assert not fake.template.children  # nothing is left waiting for an exit


async def test_a_fork_no_one_waits_for_any_more_is_killed(fake_of) -> None:  # type: ignore[no-untyped-def]
    started: list[subprocess.Popen[bytes]] = []
    answer = asyncio.Event()

    def late(fake: Fake, fork: Fork) -> None:
        async def reply() -> None:
            await answer.wait()  # the start was cancelled meanwhile
            child = subprocess.Popen(["sleep", "60"])
            started.append(child)
            pidfd = os.pidfd_open(child.pid)
            fake.send(Forked(fork.seq, pid=child.pid), pidfd=pidfd)
            os.close(pidfd)

        asyncio.ensure_future(reply())  # noqa: RUF006 - awaited through ``started``

    fake = fake_of(Status(True, pid=1), late)
    channel = os.open(os.devnull, os.O_RDONLY)
    start = asyncio.ensure_future(fake.template.fork({}, "INFO", channel, 30))
    await asyncio.sleep(0.2)
    start.cancel()
    with pytest.raises(asyncio.CancelledError):
        await start
    os.close(channel)
    answer.set()
    while not started:
        await asyncio.sleep(0.02)
    assert await asyncio.to_thread(started[0].wait, 10) == -9  # killed: no worker runs unseen


def test_the_template_imports_with_one_blas_thread_and_freezes_what_it_imported() -> None:
    """Forked CPU workers would otherwise each run numpy's OpenBLAS pool of every core (it is sized at load, in
    the template), and unshare the template's pages at their first full collection."""
    probe = ("import gc, os, diffusiond.worker.template as t; t._set_env(); t._imports(False, True); "
             "threads = open('/proc/self/status').read().split('Threads:')[1].split()[0]; "
             "print(gc.get_freeze_count() > 1000, threads, os.environ['OPENBLAS_NUM_THREADS'], "
             "len(t._native_threads()))")
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS",
                                                              "OMP_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "1", "1", "0"], out
    # a thread count the user set is theirs: the template leaves it, and names the pool's native thread it sees
    out = subprocess.run([sys.executable, "-c", probe], env={**env, "OPENBLAS_NUM_THREADS": "2"},
                         capture_output=True, text=True, check=True)
    assert out.stdout.split()[1:] == ["2", "2", "1"], out


async def test_a_start_cancelled_mid_fork_closes_the_engines_end(fake_of) -> None:  # type: ignore[no-untyped-def]
    fake = fake_of(Status(True, pid=1), lambda fake, fork: None)  # never answers
    fake.kept = []  # the worker's channel, held as a forked worker would hold it
    handle = WorkerHandle(config("synthetic:compute_ms=1"), on_frame=lambda *_: None, on_lost=lambda *_: None,
                          template=fake.template)
    start = asyncio.ensure_future(handle.start(timeout=600))
    while not fake.kept:
        await asyncio.sleep(0.02)
    start.cancel()
    with pytest.raises(asyncio.CancelledError):
        await start
    (channel,) = fake.kept
    channel.settimeout(10)
    assert channel.recv(16) == b""  # EOF: nothing holds the engine's end open
    channel.close()


def test_a_template_whose_engine_closed_its_end_leaves_quietly_as_its_children_end() -> None:
    probe = ("import os, socket, diffusiond.worker.template as t; a, b = socket.socketpair(socket.AF_UNIX, "
             "socket.SOCK_SEQPACKET); b.close(); pid = os.fork(); pid or os._exit(0); os.waitid(os.P_PID, pid, "
             "os.WEXITED | os.WNOWAIT); print(t._reap(a, {pid}))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout.strip(), out.stderr) == (0, "False", ""), out


async def test_a_template_broken_by_an_unreadable_message_is_killed_and_reaped(fake_of) -> None:  # type: ignore[no-untyped-def]
    fake = fake_of(Status(True, pid=1), lambda fake, fork: fake.sock.send(b"\xc1"))  # not msgpack
    channel = os.open(os.devnull, os.O_RDONLY)
    assert await fake.template.fork({}, "INFO", channel, 30) is None  # this worker starts fresh instead
    os.close(channel)
    assert fake.template.broken is not None and "unreadable message" in fake.template.broken
    pid = fake.stand_in.pid
    for _ in range(500):
        if not os.path.exists(f"/proc/{pid}"):
            break  # killed and reaped: no <defunct> left until the daemon stops
        await asyncio.sleep(0.02)
    else:
        raise AssertionError(f"the template {pid} is still in the process table")


def _dies(fake: Fake, fork: Fork) -> None:
    fake.stand_in.kill()  # the template dies holding the worker's channel
    fake.close()


FALLBACKS = {
    "unusable": (Status(False, "RuntimeError: CUDA was initialised during the imports", 1), _exits_at_once,
                 "it is unusable: RuntimeError: CUDA was initialised"),
    "fork refused": (Status(True, pid=1), lambda fake, fork: fake.send(Forked(fork.seq, error="fork: no memory")),
                     None),
    "dies mid-fork": (Status(True, pid=1), _dies, "it died|it was killed by signal SIGKILL"),
}


@pytest.mark.parametrize("fault", FALLBACKS)
async def test_a_worker_the_template_cannot_fork_starts_fresh_and_runs_its_job(fake_of, fault: str) -> None:  # type: ignore[no-untyped-def]
    status, script, broken = FALLBACKS[fault]
    fake = fake_of(status, script)
    driver = Driver(config("synthetic:compute_ms=1"))
    driver.handle = WorkerHandle(driver.handle.config, on_frame=driver._on_frame, on_lost=driver._on_lost,
                                 template=fake.template)
    async with driver:
        assert isinstance(driver.handle.proc, asyncio.subprocess.Process)  # a fresh interpreter, not a fork
        (result,) = await driver.run(PARAMS, [7])
        assert result.array is not None and result.array.shape == (32, 32, 3)
    # a refused fork is that worker's alone; the others break the template for every later start
    assert fake.template.broken is None if broken is None else re.match(broken, fake.template.broken or "")
