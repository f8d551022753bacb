"""Access control: socket mode, SO_PEERCRED allow-list (a client really running as another
uid), and the TCP listener's bearer token."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

NOBODY = 65534
CLIENT = (
    "import os, socket, sys; os.setgid({uid}); os.setuid({uid}); c = socket.socket(socket.AF_UNIX); "
    "c.connect(sys.argv[1]); c.sendall(b'GET /v1/models HTTP/1.1\\r\\nHost: x\\r\\nConnection: close\\r\\n\\r\\n'); "
    "sys.stdout.write(c.recv(65536).decode(errors='replace'))"
)


@pytest.fixture
def open_dir():  # type: ignore[no-untyped-def]
    """A directory other uids can traverse (pytest's tmp_path is owner-only), so that what is
    tested is the socket's own permission and the uid check, not the path to it."""
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="diffusiond-test-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def as_uid(uid: int, sock: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", CLIENT.format(uid=uid), str(sock)], capture_output=True,
                          text=True, timeout=60)


def test_daemon_socket_is_owner_only_by_default(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    d = daemon_factory("--model", "tiny")
    assert stat.S_IMODE(os.stat(d.socket).st_mode) == 0o600


@pytest.mark.skipif(os.geteuid() != 0, reason="running a client as another uid needs root")
def test_daemon_allow_uid_refuses_other_uids(daemon_factory, open_dir: Path) -> None:  # type: ignore[no-untyped-def]
    d = daemon_factory("--model", "tiny", "--socket-mode", "666", "--allow-uid", "4242", socket_dir=open_dir)
    refused = as_uid(NOBODY, d.socket)
    assert " 403 " in refused.stdout.split("\r\n", 1)[0], refused
    assert "uid 65534 is not allowed" in refused.stdout
    allowed = as_uid(4242, d.socket)
    assert " 200 " in allowed.stdout.split("\r\n", 1)[0], allowed


@pytest.mark.skipif(os.geteuid() != 0, reason="running a client as another uid needs root")
def test_daemon_default_mode_keeps_other_uids_out(daemon_factory, open_dir: Path) -> None:  # type: ignore[no-untyped-def]
    d = daemon_factory("--model", "tiny", socket_dir=open_dir)
    out = as_uid(NOBODY, d.socket)
    assert out.returncode != 0 and "Permission denied" in out.stderr


def test_daemon_tcp_listener_requires_the_bearer_token(daemon_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token-of-enough-length\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    daemon_factory("--model", "tiny", "--tcp", f"127.0.0.1:{port}", "--token-file", str(token_file))

    def get(headers: str) -> str:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as c:
            c.sendall(f"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{headers}\r\n".encode())
            data = b""
            while chunk := c.recv(65536):
                data += chunk
        return data.decode(errors="replace")

    assert " 401 " in get("").split("\r\n", 1)[0]
    assert " 401 " in get("Authorization: Bearer wrong\r\n").split("\r\n", 1)[0]
    ok = get("Authorization: Bearer s3cret-token-of-enough-length\r\n")
    assert " 200 " in ok.split("\r\n", 1)[0] and '"tiny"' in ok


def test_daemon_refuses_tcp_without_a_token_file(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "diffusiond", "serve", "--tcp", "127.0.0.1:0", "--socket",
                          str(tmp_path / "s.sock")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "token" in out.stderr


def test_the_socket_path_appears_only_once_it_accepts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that connects as soon as the path exists (a script polling for it, the test kit) was refused
    in the instant between bind and listen: the path now appears listening, with its mode."""
    import diffusiond.daemon.server as server

    path = tmp_path / "d.sock"
    answers: list[str] = []
    chmod = os.chmod

    def chmod_then_connect(target: str, mode: int) -> None:  # between bind and listen: a client connects now
        chmod(target, mode)
        if path.exists():
            with socket.socket(socket.AF_UNIX) as c:
                try:
                    c.connect(str(path))
                    answers.append("accepted")
                except ConnectionRefusedError:
                    answers.append("refused")

    monkeypatch.setattr(os, "chmod", chmod_then_connect)
    sock = server.bind_unix(str(path), 0o600, None)
    try:
        assert "refused" not in answers
        with socket.socket(socket.AF_UNIX) as c:
            c.connect(str(path))
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert os.listdir(tmp_path) == ["d.sock"]  # the temporary name it was bound under is gone
    finally:
        sock.close()


def _path_of(tmp_path: Path, nbytes: int) -> Path:
    """A socket path of exactly ``nbytes`` bytes in a directory of ``tmp_path``'s (a Unix socket's limit is 107)."""
    room = nbytes - len(os.fsencode(str(tmp_path))) - len("/d/") - len("s")
    assert room > 0, "pytest's temporary directory is already too long for this test"
    (tmp_path / "d").mkdir()
    return tmp_path / "d" / ("x" * room + "s")


def test_a_socket_path_at_the_limit_still_binds(tmp_path: Path) -> None:
    """Bound under a temporary name first, which must not make a path that fits the limit fail to start
    (``make demo`` under pytest's long temporary directory did)."""
    import diffusiond.daemon.server as server

    path = _path_of(tmp_path, server.SUN_PATH_MAX)
    sock = server.bind_unix(str(path), 0o600, None)
    try:
        with socket.socket(socket.AF_UNIX) as c:
            c.connect(str(path))
        assert os.listdir(path.parent) == [path.name]
    finally:
        sock.close()


def test_a_socket_path_over_the_limit_is_refused_naming_the_limit(tmp_path: Path) -> None:
    import diffusiond.daemon.server as server

    path = _path_of(tmp_path, server.SUN_PATH_MAX + 1)
    with pytest.raises(server.StartupError, match=r"at most 107: choose a shorter --socket"):
        server.bind_unix(str(path), 0o600, None)
    assert os.listdir(path.parent) == []
