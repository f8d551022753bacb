"""The worker template's faults (issue 27's cold start), against a fake template on a socketpair.

The engine's end (``daemon/workers/template.py``) talks to a coroutine that answers as the template would, so a
child that exits at once, an unusable template, a failed fork and a template dying mid-fork are each one script;
where the fallback matters, the real ``WorkerHandle`` then starts a fresh interpreter (a synthetic model) and
runs a job on it.
"""

from __future__ import annotations

import asyncio
import gc
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Callable

import pytest
from enginekit import until
from workerkit import Driver, config

import diffusiond.daemon.workers.template as templates
import diffusiond.ipc.messages as m
from diffusiond.daemon.workers.handle import WorkerHandle
from diffusiond.daemon.workers.link import WorkerStartError
from diffusiond.daemon.workers.template import ForkedProcess, Template
from diffusiond.ipc.template import MAX_MESSAGE, Exited, Fork, Forked, Status, decode_request, encode, socketpair
from diffusiond.protocol import WorkerState

PARAMS = m.BatchParams(width=32, height=32, steps=2, guidance=1.0)
Script = Callable[["Fake", Fork], None]


class Fake:
    """The template's side of the socketpair: says ``status`` (None: nothing, its imports hang), then answers each
    FORK with ``script``. ``stand_in`` is the process the engine kills when it breaks and reaps."""

    def __init__(self, status: Status | None, script: Script, stand_in: tuple[str, ...] = ("sleep", "60")) -> None:
        self.script = script
        self.kept: list[socket.socket] | None = None  # the channels received, where a test keeps them open
        self.workers: list[subprocess.Popen[bytes]] = []  # real workers a script started, never waited for here
        mine, self.sock = socketpair()
        self.stand_in = subprocess.Popen(stand_in)
        self.template = Template(self.stand_in, mine, "on")
        self.sock.setblocking(False)
        if status is not None:
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
        for worker in self.workers:
            worker.kill()
            worker.wait()
        await self.template.close()


@pytest.fixture
async def fake_of() -> AsyncIterator[Callable[[Status, Script], Fake]]:
    fakes: list[Fake] = []

    def make(status: Status | None, script: Script, stand_in: tuple[str, ...] = ("sleep", "60")) -> Fake:
        fakes.append(Fake(status, script, stand_in))
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





def _forks_then_goes_quiet(fake: Fake, fork: Fork) -> None:
    """A template that forks (here: a real worker, spawned on the channel it was sent) and then says nothing more,
    as one stopped (SIGSTOP, a cgroup freezer, a debugger) or wedged: no EXITED comes, and its ended child stays
    a zombie, reaped by no one (here: until the fixture's end)."""
    assert fake.kept
    channel = fake.kept.pop()
    worker = subprocess.Popen([sys.executable, "-m", "diffusiond.worker", "--fd", str(channel.fileno())],
                              pass_fds=(channel.fileno(),), stdin=subprocess.DEVNULL, env={**os.environ, **fork.env})
    channel.close()
    fake.workers.append(worker)
    pidfd = os.pidfd_open(worker.pid)
    fake.send(Forked(fork.seq, pid=worker.pid), pidfd=pidfd)
    os.close(pidfd)


@pytest.mark.parametrize("end", ["dies", "is stopped"])
async def test_a_forked_worker_whose_end_its_template_never_reports_is_still_seen_to_end(  # type: ignore[no-untyped-def]
        fake_of, monkeypatch, end: str) -> None:
    """Its end was seen only through EXITED, so with the template stopped a dead worker stayed
    ``ready`` and was never replaced, and the daemon's stop waited for one it had stopped, for good."""
    monkeypatch.setattr(templates, "EXIT_GRACE_S", 0.2)
    fake = fake_of(Status(True, pid=1), _forks_then_goes_quiet)
    fake.kept = []
    driver = Driver(config("synthetic:compute_ms=1"))
    driver.handle = WorkerHandle(driver.handle.config, on_frame=driver._on_frame, on_lost=driver._on_lost,
                                 template=fake.template)
    async with driver:
        assert isinstance(driver.handle.proc, ForkedProcess)
        (result,) = await driver.run(PARAMS, [7])
        assert result.array is not None
        (worker,) = fake.workers
        if end == "dies":
            worker.kill()
            await until(lambda: driver.lost, 30, "the worker's loss to be reported")
        else:  # the daemon stops: SHUTDOWN, and the worker exits
            await asyncio.wait_for(driver.handle.stop(timeout=10), 30)
    assert driver.handle.state == WorkerState.DEAD
    why = f"it did not report the end of worker pid {worker.pid} within 0.2s"
    reason = f"worker 0 (pid {worker.pid}, cpu) ended; its exit status is unknown (its worker template stopped: {why})"
    assert driver.handle.lost_reason == reason
    assert driver.lost == ([reason] if end == "dies" else [])  # a worker the engine stopped is not reported lost
    assert fake.template.broken == why  # it no longer answers: later workers start fresh
    assert await asyncio.to_thread(fake.stand_in.wait, 10) == -9  # and it was killed


async def test_a_template_whose_imports_hang_leaves_the_fresh_worker_a_whole_start_timeout(fake_of) -> None:  # type: ignore[no-untyped-def]
    """The template's imports took the worker's whole start timeout, then the fresh interpreter
    started in its place got the 0 s left and was killed at once, failing the daemon's start."""
    fake = fake_of(None, _exits_at_once)  # it never says READY
    driver = Driver(config("synthetic:compute_ms=1"), start_timeout=20)
    driver.handle = WorkerHandle(driver.handle.config, on_frame=driver._on_frame, on_lost=driver._on_lost,
                                 template=fake.template)
    async with driver:
        assert isinstance(driver.handle.proc, asyncio.subprocess.Process)
        (result,) = await driver.run(PARAMS, [7])
        assert result.array is not None
    assert fake.template.broken == "its imports did not finish within 20s"


async def test_a_hung_templates_imports_and_fork_are_bounded_on_their_own_terms(fake_of, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The imports' wait is bounded whatever the start timeout (900 s by default), the fork's
    by what is left of it, and each says what timed out (``str(TimeoutError())`` is empty)."""
    monkeypatch.setattr(templates, "IMPORTS_TIMEOUT_S", 0.5)
    channel = os.open(os.devnull, os.O_RDONLY)
    hung = fake_of(None, _exits_at_once)
    assert await asyncio.wait_for(hung.template.fork({}, "INFO", channel, 900), 30) is None
    assert hung.template.broken == "its imports did not finish within 0.5s"
    quiet = fake_of(Status(True, pid=1), lambda fake, fork: None)  # never answers a FORK
    assert await asyncio.wait_for(quiet.template.fork({}, "INFO", channel, 1), 20) is None  # 1 s left, not 30 s
    said = re.fullmatch(r"it did not answer a fork request within (\d\.\d)s", quiet.template.broken or "")
    assert said is not None and 0.5 <= float(said[1]) <= 1.0, quiet.template.broken  # what was left of the 1 s
    os.close(channel)


ENDS_BEFORE_A_FORK = {
    "unusable": (Status(False, "RuntimeError: the imports started threads (x); a fork copies only one", 7),
                 ("sh", "-c", "exit 1"), "it is unusable: RuntimeError: the imports started threads (x); "
                 "a fork copies only one"),
    "killed": (Status(True, pid=7), ("sleep", "60"), "it was killed by signal SIGKILL"),
    # a real-time signal has no name in ``signal.Signals``: naming it raised in the reaping task, and the daemon's
    # stop, which awaits that task, ended there, its outputs unsettled and its store left open
    "killed by signal 35": (Status(True, pid=7), ("sleep", "60"), "it was killed by signal 35"),
}
KILLS = {"killed": signal.SIGKILL, "killed by signal 35": 35}


@pytest.mark.parametrize("end", ENDS_BEFORE_A_FORK)
async def test_a_template_that_ends_before_any_fork_is_reaped_and_says_why(  # type: ignore[no-untyped-def]
        fake_of, monkeypatch, caplog, end: str) -> None:
    """Read from the first fork only, it stayed <defunct> with nothing logged until then (with
    ``--preload none``, maybe for good), and an unusable one's reason, queued with its EOF, was logged as "it died"."""
    status, stand_in, why = ENDS_BEFORE_A_FORK[end]
    fake = fake_of(status, _exits_at_once, stand_in)
    if end in KILLS:
        os.kill(fake.stand_in.pid, KILLS[end])
    fake.close()  # its EOF, queued behind its status
    monkeypatch.setattr(templates, "_SPAWNED", fake.template)
    assert templates.claim() is fake.template  # as the pool takes it, on the loop: no fork needed from here
    line = (f"the worker template (pid {fake.stand_in.pid}) stopped forking workers: {why}; workers start as "
            "fresh interpreters from now on")
    await until(lambda: line in caplog.text, 30, repr(line))
    assert fake.stand_in.returncode is not None  # reaped
    assert fake.template.broken == why


async def test_a_start_that_times_out_leaves_no_exception_unretrieved(caplog) -> None:  # type: ignore[no-untyped-def]
    """The worker is reaped after its start gave up waiting, and the exception its READY future
    then got was logged by asyncio with a traceback, as an error ("Future exception was never retrieved")."""
    handle = WorkerHandle(config("synthetic:compute_ms=1"), on_frame=lambda *_: None, on_lost=lambda *_: None)
    with pytest.raises(WorkerStartError, match=r"did not load 'synthetic:compute_ms=1'"):
        await handle.start(timeout=0.05)
    await asyncio.wait_for(handle.wait_lost(), 30)
    del handle
    gc.collect()
    await asyncio.sleep(0)
    assert "never retrieved" not in caplog.text


async def test_a_worker_stopped_while_its_template_still_imports_never_comes_up(fake_of) -> None:  # type: ignore[no-untyped-def]
    """The pool stops a worker whose start still waits for the template (the daemon's stop, a retire): its stop
    waited for good on a channel that did not exist yet, and the start, once the fork came, set it READY."""
    fake = fake_of(None, _exits_at_once)  # its imports never finish
    handle = WorkerHandle(config("synthetic:compute_ms=1"), on_frame=lambda *_: None, on_lost=lambda *_: None,
                          template=fake.template)
    start = asyncio.ensure_future(handle.start(timeout=600))
    await asyncio.sleep(0.2)  # the start waits in the template's fork
    await asyncio.wait_for(handle.stop(10), 20)
    with pytest.raises(WorkerStartError, match=r"worker 0 \(pid None, cpu\) was stopped while it started"):
        await asyncio.wait_for(start, 20)
    assert handle.state == WorkerState.DEAD and handle.proc is None  # no fresh interpreter started in its place


async def test_a_worker_stopped_before_its_start_ran_never_waits_for_the_template(fake_of) -> None:  # type: ignore[no-untyped-def]
    """A stop that came before the start's task first ran returned at once, and the start then still waited for the
    template's imports (up to minutes) before it saw the stop."""
    fake = fake_of(None, _exits_at_once)  # its imports never finish
    handle = WorkerHandle(config("synthetic:compute_ms=1"), on_frame=lambda *_: None, on_lost=lambda *_: None,
                          template=fake.template)
    start = asyncio.ensure_future(handle.start(timeout=600))
    await handle.stop(10)  # the start's task has not run yet
    with pytest.raises(WorkerStartError, match=r"worker 0 \(pid None, cpu\) was stopped before it started"):
        await asyncio.wait_for(start, 20)
    assert handle.state == WorkerState.DEAD and handle.proc is None
    assert await asyncio.wait_for(handle.wait_lost(), 20) == "worker 0 (pid None, cpu) was stopped while it started"
