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

import pytest

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


def test_into_the_journal_the_web_page_is_logged_without_its_token(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """Groups adm and systemd-journal read the journal; the token opens the page and the API. systemd
    says which stream is the journal in JOURNAL_STREAM (device:inode): here the daemon's log file."""
    from diffusiond import Client

    d = daemon_factory("--model", "tiny", "--web", "127.0.0.1:0", env={"OMP_NUM_THREADS": "1"}, start=False)
    d.log_path.touch()  # the daemon's stderr: spawn opens it again, the same inode
    st = d.log_path.stat()
    d.env["JOURNAL_STREAM"] = f"{st.st_dev}:{st.st_ino}"
    d.start()
    with Client(str(d.socket)) as c:
        url = c.web_url()
    page, token = url.split("?token=", 1)
    log = d.log()
    assert token and token not in log, log
    assert f"web page: {page} " in log and "diffusiond web-url" in log, log


def test_a_journal_stream_inherited_by_another_stream_is_not_the_journal(monkeypatch: pytest.MonkeyPatch) -> None:
    """A shell started from a service (a terminal under a user manager) inherits JOURNAL_STREAM while
    writing to a terminal: its user still needs the URL with the token."""
    from diffusiond.daemon.edge.web import sign_in_url

    st = os.fstat(2)
    for value, journal in ((f"{st.st_dev}:{st.st_ino}", True), (f"{st.st_dev}:{st.st_ino + 1}", False),
                           ("", False), ("garbage", False)):
        monkeypatch.setenv("JOURNAL_STREAM", value)
        logged = sign_in_url("127.0.0.1", 7860, "t+k", for_log=True)
        assert ("?token=t%2Bk" not in logged) is journal, (value, logged)
    monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
    assert sign_in_url("127.0.0.1", 7860, "t+k") == "http://127.0.0.1:7860/?token=t%2Bk"  # web-url's is whole
