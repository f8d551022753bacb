"""The daemon under (simulated) systemd: socket activation and sd_notify, without systemd.

A datagram socket stands in for NOTIFY_SOCKET and receives what the daemon reports; a listening
socket created here is handed to ``diffusiond serve`` as fd 3 with LISTEN_FDS/LISTEN_PID, the
way systemd's socket units do it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from conftest import ROOT

# Puts the inherited socket at fd 3 and sets LISTEN_PID to the pid that exec keeps.
TRAMPOLINE = (
    "import os, sys; fd = int(sys.argv[1]); os.dup2(fd, 3); os.close(fd); "
    "os.environ['LISTEN_PID'] = str(os.getpid()); os.environ['LISTEN_FDS'] = '1'; "
    "os.execv(sys.executable, [sys.executable, '-m', 'diffusiond', *sys.argv[2:]])"
)


def _recv_all(notify: socket.socket, until: str, timeout: float) -> list[str]:
    got: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        notify.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            got.extend(notify.recv(4096).decode().split("\n"))
        except TimeoutError:
            break
        if any(line.startswith(until) for line in got):
            break
    return got


def _get(path: str, url: str) -> bytes:
    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    c.settimeout(30)
    c.connect(path)
    c.sendall(f"GET {url} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    data = b""
    while chunk := c.recv(65536):
        data += chunk
    c.close()
    return data


def test_daemon_socket_activation_and_notify(tmp_path: Path, model_cache: Path) -> None:
    listen_path = str(tmp_path / "activated.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(listen_path)
    listener.listen(16)
    listener.set_inheritable(True)
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify"))
    env = dict(os.environ, NOTIFY_SOCKET=str(tmp_path / "notify"), WATCHDOG_USEC="2000000",
               DIFFUSIOND_CACHE=str(model_cache))
    proc = subprocess.Popen(
        [sys.executable, "-c", TRAMPOLINE, str(listener.fileno()), "serve", "--model", "tiny",
         "--socket", str(tmp_path / "unused.sock")],
        pass_fds=[listener.fileno()], env=env, cwd=ROOT,
    )
    listener.close()  # the daemon holds it now
    try:
        env["WATCHDOG_PID"] = str(proc.pid)
        lines = _recv_all(notify, "READY=1", 120)
        assert "READY=1" in lines, lines
        assert any(line.startswith("STATUS=starting") for line in lines)
        assert any(line.startswith("STATUS=serving") for line in lines)
        assert not any("loading" in line for line in lines), lines  # socket-activated: it preloads nothing
        # the daemon serves on the inherited socket and did not create its own
        assert b'"ready": true' in _get(listen_path, "/ready")
        assert not (tmp_path / "unused.sock").exists()
        # socket-activated, it loads nothing it was not asked to: no worker, the model on disk
        assert b'"workers": []' in _get(listen_path, "/health")
        assert b'"residency": "disk"' in _get(listen_path, "/v1/models")
        proc.send_signal(signal.SIGTERM)
        rest = _recv_all(notify, "STOPPING=1", 60)
        assert "STOPPING=1" in rest
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        notify.close()


def test_daemon_pings_the_watchdog_from_its_loop(tmp_path: Path, model_cache: Path) -> None:
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify"))
    # WATCHDOG_PID must name the daemon; a trampoline sets it to the pid exec keeps
    tramp = ("import os, sys; os.environ['WATCHDOG_PID'] = str(os.getpid()); "
             "os.execv(sys.executable, [sys.executable, '-m', 'diffusiond', *sys.argv[1:]])")
    env = dict(os.environ, NOTIFY_SOCKET=str(tmp_path / "notify"), WATCHDOG_USEC="400000",
               DIFFUSIOND_CACHE=str(model_cache))
    proc = subprocess.Popen([sys.executable, "-c", tramp, "serve", "--model", "tiny", "--socket",
                             str(tmp_path / "d.sock")], env=env, cwd=ROOT)
    try:
        lines = _recv_all(notify, "READY=1", 120)
        assert "READY=1" in lines
        # READY=1 means admitting (issue 27): sent as the preload begins, its STATUS names what it loads,
        # and a second STATUS says when the preload is done
        assert any(line.startswith("STATUS=serving") and line.endswith("; loading tiny") for line in lines), lines
        rest = _recv_all(notify, "STATUS=serving on", 120)
        assert any(line.endswith("the start's preload is done") for line in rest), rest
        pings = [line for line in _recv_all(notify, "never", 1.5) if line == "WATCHDOG=1"]
        assert len(pings) >= 2  # every 0.2 s (half the interval) while the loop is alive
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        notify.close()
