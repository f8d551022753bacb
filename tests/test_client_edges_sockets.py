"""The client's sockets at their edges, against one real daemon on ``tiny``: a live update whose header is larger
than a socket buffer, sent by a client with a timeout (its socket is non-blocking then); a daemon of another user,
whose sockets refuse this one."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from daemonkit import Daemon

import diffusiond.client.weights  # noqa: F401 - imported before a child drops to a user who cannot read the venv
from diffusiond.client import AsyncClient, Client, DaemonError

NOBODY = 65534


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Iterator[Daemon]:
    """Its socket (mode 0600, the default) in a directory anyone may enter: what refuses another user is the
    socket's own mode, not the directory on the way to it."""
    where = Path(tempfile.mkdtemp(prefix="dd-edges-", dir="/tmp"))
    where.chmod(0o755)
    args = ["--model", "tiny", "--workers", "1", "--no-persist", "--job-timeout", "300"]
    d = Daemon(where / "d.sock", args, tmp_path_factory.mktemp("client-edges") / "d.log",
               env={"DIFFUSIOND_CACHE": str(model_cache), "OMP_NUM_THREADS": "1"})
    try:
        d.start()
        yield d
    finally:
        d.stop()
        shutil.rmtree(where, ignore_errors=True)


def test_an_update_whose_header_outgrows_the_socket_buffer_reaches_the_daemon_whole(tiny: Daemon) -> None:
    """3,000 tensors make a header of about 400 KB, more than an AF_UNIX socket takes in one non-blocking send. Cut
    there, the daemon waited for the rest and the trainer got ClientTimeout; whole, the daemon reads every name and
    refuses the first one that matches no layer of tiny (its answer is the proof that it read the frame)."""
    prefix = "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.no_such_layer_" + "x" * 40
    tensors = {f"{prefix}{i}.lora_A.weight": np.zeros((1, 1), np.float32) for i in range(3000)}
    with Client(str(tiny.socket), timeout=30) as c, pytest.raises(DaemonError) as raised:
        c.update_lora("wide", tensors)
    assert raised.value.status == 400, raised.value
    assert "no_such_layer" in str(raised.value), raised.value


def as_another_user(work: Callable[[], object]) -> str:
    """What ``work`` raised (``Type: message``) in a forked child running as nobody. Forked, not spawned: nobody
    may not read the interpreter under /root, so everything the child runs is imported here first."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            try:
                work()
                out = "no error"
            except BaseException as exc:
                out = f"{type(exc).__name__}: {exc}"
            os.write(write, out.encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        out = f.read().decode()
    os.waitpid(pid, 0)
    return out


@pytest.mark.skipif(os.geteuid() != 0, reason="becoming another user takes root")
def test_another_users_daemon_is_reported_as_such_not_as_no_daemon(tiny: Daemon) -> None:
    """EACCES on a live daemon's socket told the user to start a daemon on the very path it holds."""
    async def status() -> None:
        async with AsyncClient(str(tiny.socket), timeout=10) as c:
            await c.health()

    said = as_another_user(lambda: asyncio.run(status()))
    assert said.startswith(f"DaemonUnreachable: {tiny.socket} refuses this user (Permission denied)"), said
    assert "runs as another user" in said and "--socket-group" in said and "Start one" not in said, said


@pytest.mark.skipif(os.geteuid() != 0, reason="becoming another user takes root")
def test_a_live_update_from_another_user_says_only_the_daemons_own_user_may_send_one(tiny: Daemon) -> None:
    """The output socket is the daemon's user's alone, whatever --allow-uid opens: the refusal says so rather
    than "no daemon, start one"."""
    async def update() -> None:
        async with AsyncClient(str(tiny.socket), timeout=10) as c:
            await c.update_lora("ink", {"w": np.zeros((1, 1), np.float32)})

    said = as_another_user(lambda: asyncio.run(update()))
    assert said.startswith(f"DaemonUnreachable: {tiny.socket} refuses this user"), said
    assert "only the daemon's own user may use" in said and "Start one" not in said, said


UPDATE_THEN_WAIT = """
import asyncio, sys
import numpy as np
from diffusiond.client import AsyncClient

async def main():
    async with AsyncClient(sys.argv[1]) as c:
        print("sending", flush=True)
        await c.update_lora("ink", {"a.lora_A.weight": np.zeros((1, 1), np.float32)})

asyncio.run(main())
"""


def test_ctrl_c_during_an_update_the_daemon_does_not_answer_ends_the_program(tmp_path: Path) -> None:
    """The update waited for its answer in asyncio's executor, and on Ctrl-C ``asyncio.run`` waited for that thread:
    a daemon that took the update and did not answer (no timeout: answers come once every worker applied it) held
    the program forever. Here the output socket is one that takes connections and never reads."""
    import signal
    import subprocess
    import sys
    import time

    from conftest import ROOT

    sock = tmp_path / "d.sock"
    with socket_listening(str(sock) + ".out"):
        proc = subprocess.Popen([sys.executable, "-c", UPDATE_THEN_WAIT, str(sock)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, cwd=ROOT)
        try:
            assert proc.stdout is not None and proc.stdout.readline() == "sending\n"
            time.sleep(0.5)  # into the wait for the answer
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail("the program did not end on Ctrl-C while its update waited for an answer")
        finally:
            if proc.poll() is None:
                proc.kill()
    assert "KeyboardInterrupt" in err, err


@contextlib.contextmanager
def socket_listening(path: str) -> Iterator[None]:
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(path)
        s.listen(4)
        yield
