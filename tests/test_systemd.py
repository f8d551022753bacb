"""systemd integration without systemd: the notify, watchdog and socket-activation protocols are
exercised against real sockets and a real child process, and the unit files are checked for the
settings the daemon's behaviour depends on (readiness, kill mode, stop timeout, socket mode).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import diffusiond
from diffusiond.daemon import systemd

REPO = Path(diffusiond.__file__).resolve().parents[1]
UNITS = REPO / "systemd"
SYSTEM_SERVICE = UNITS / "diffusiond.service"
SYSTEM_SOCKET = UNITS / "diffusiond.socket"
USER_SERVICE = UNITS / "user" / "diffusiond.service"
USER_SOCKET = UNITS / "user" / "diffusiond.socket"

# The daemon's default drain grace on SIGTERM; TimeoutStopSec must exceed it.
DEFAULT_DRAIN_GRACE_S = 30

# A Unix socket path is limited to 107 bytes; pytest's tmp_path can be longer.
_MAX_SUN_PATH = 100


@pytest.fixture
def sock_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory whose socket paths fit in sun_path: tmp_path if short enough."""
    if len(str(tmp_path / "x.sock")) <= _MAX_SUN_PATH:
        yield tmp_path
        return
    short = Path(tempfile.mkdtemp(prefix="dfd-"))
    try:
        yield short
    finally:
        shutil.rmtree(short, ignore_errors=True)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No systemd variables leak in from the environment the tests run in."""
    for name in (
        "NOTIFY_SOCKET",
        "WATCHDOG_USEC",
        "WATCHDOG_PID",
        "LISTEN_FDS",
        "LISTEN_PID",
        "LISTEN_FDNAMES",
    ):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _receiver(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    sock.settimeout(5)
    return sock


# --- notify ------------------------------------------------------------------------------------


def test_notify_sends_lines_as_one_datagram(sock_dir: Path, clean_env: pytest.MonkeyPatch) -> None:
    path = str(sock_dir / "notify.sock")
    with _receiver(path) as receiver:
        clean_env.setenv("NOTIFY_SOCKET", path)
        assert systemd.notify("READY=1", "STATUS=hello") is True
        assert receiver.recv(4096) == b"READY=1\nSTATUS=hello"


def test_notify_abstract_socket(clean_env: pytest.MonkeyPatch) -> None:
    name = f"diffusiond-test-{uuid.uuid4().hex}"
    with _receiver("\0" + name) as receiver:
        clean_env.setenv("NOTIFY_SOCKET", "@" + name)
        assert systemd.notify("STOPPING=1") is True
        assert receiver.recv(4096) == b"STOPPING=1"


def test_notify_flattens_newlines_inside_a_line(sock_dir: Path, clean_env: pytest.MonkeyPatch) -> None:
    path = str(sock_dir / "notify.sock")
    with _receiver(path) as receiver:
        clean_env.setenv("NOTIFY_SOCKET", path)
        assert systemd.notify("STATUS=loading\nREADY=1")
        assert receiver.recv(4096) == b"STATUS=loading READY=1"


def test_notify_without_systemd_is_a_noop(clean_env: pytest.MonkeyPatch) -> None:
    assert systemd.notify("READY=1") is False
    clean_env.setenv("NOTIFY_SOCKET", "")
    assert systemd.notify("READY=1") is False


@pytest.mark.parametrize("address", ["/nonexistent/diffusiond/notify.sock", "relative.sock", "@"])
def test_notify_send_errors_return_false(address: str, clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("NOTIFY_SOCKET", address)
    assert systemd.notify("READY=1") is False


def test_notify_to_a_path_that_is_not_a_socket(tmp_path: Path, clean_env: pytest.MonkeyPatch) -> None:
    path = tmp_path / "plain-file"
    path.write_text("")
    clean_env.setenv("NOTIFY_SOCKET", str(path))
    assert systemd.notify("READY=1") is False


# --- watchdog ----------------------------------------------------------------------------------


def test_watchdog_interval_is_half_of_watchdog_usec(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("WATCHDOG_USEC", "30000000")
    assert systemd.watchdog_interval() == pytest.approx(15.0)
    clean_env.setenv("WATCHDOG_PID", str(os.getpid()))
    assert systemd.watchdog_interval() == pytest.approx(15.0)


@pytest.mark.parametrize(
    ("usec", "pid"),
    [
        (None, None),  # no watchdog configured
        ("", None),
        ("0", None),
        ("-5", None),
        ("not-a-number", None),
        ("30000000", "not-a-pid"),
        ("30000000", "other"),  # inherited by a child: not ours to ping
    ],
)
def test_watchdog_interval_none(usec: str | None, pid: str | None, clean_env: pytest.MonkeyPatch) -> None:
    if usec is not None:
        clean_env.setenv("WATCHDOG_USEC", usec)
    if pid == "other":
        pid = str(os.getpid() + 1)
    if pid is not None:
        clean_env.setenv("WATCHDOG_PID", pid)
    assert systemd.watchdog_interval() is None


async def test_watchdog_loop_pings_from_the_event_loop(sock_dir: Path, clean_env: pytest.MonkeyPatch) -> None:
    path = str(sock_dir / "notify.sock")
    with _receiver(path) as receiver:
        receiver.setblocking(False)
        clean_env.setenv("NOTIFY_SOCKET", path)
        loop = asyncio.get_running_loop()
        task = asyncio.create_task(systemd.watchdog_loop(0.01))
        try:
            pings = [await asyncio.wait_for(loop.sock_recv(receiver, 64), 5) for _ in range(3)]
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
    assert pings == [b"WATCHDOG=1"] * 3


async def test_watchdog_loop_rejects_nonpositive_interval() -> None:
    with pytest.raises(ValueError, match="positive"):
        await systemd.watchdog_loop(0)


# --- socket activation -------------------------------------------------------------------------

# Runs in the child before exec: puts the inherited socket at fd 3 and sets LISTEN_PID to its own
# pid, which exec keeps. This is what systemd does between fork and exec.
_TRAMPOLINE = """
import os, sys
fd = int(sys.argv[1])
if fd != 3:
    os.dup2(fd, 3)
    os.close(fd)
os.environ["LISTEN_FDS"] = "1"
os.environ["LISTEN_FDNAMES"] = "diffusiond"
os.environ["LISTEN_PID"] = str(os.getpid())
os.execv(sys.executable, [sys.executable, "-c", sys.argv[2]])
"""

# The "daemon": takes its socket from systemd, serves one connection with what it saw.
_SERVER = """
import json, os
from diffusiond.daemon import systemd
named = systemd.listen_fds_with_names()
report = {
    "names": [name for name, _ in named],
    "filenos": [sock.fileno() for _, sock in named],
    "families": [int(sock.family) for _, sock in named],
    "types": [int(sock.type) for _, sock in named],
    "cloexec": [not os.get_inheritable(sock.fileno()) for _, sock in named],
    "env_left": sorted(k for k in os.environ if k.startswith("LISTEN_")),
    "second_call": len(systemd.listen_fds()),
}
_, sock = named[0]
conn, _ = sock.accept()
with conn:
    conn.sendall(json.dumps(report).encode())
"""


def test_listen_fds_in_a_socket_activated_child(sock_dir: Path) -> None:
    path = str(sock_dir / "diffusiond.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(path)
        listener.listen()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("LISTEN_", "NOTIFY_", "WATCHDOG_"))}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        child = subprocess.Popen(
            [sys.executable, "-c", _TRAMPOLINE, str(listener.fileno()), _SERVER],
            pass_fds=(listener.fileno(),),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
                client.settimeout(20)
                client.connect(path)
                chunks = []
                while chunk := client.recv(65536):
                    chunks.append(chunk)
            _, err = child.communicate(timeout=20)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
    assert child.returncode == 0, err.decode(errors="replace")
    report = json.loads(b"".join(chunks))
    assert report == {
        "names": ["diffusiond"],
        "filenos": [3],
        "families": [int(socket.AF_UNIX)],
        "types": [int(socket.SOCK_STREAM)],
        "cloexec": [True],
        "env_left": [],
        "second_call": 0,
    }


@pytest.mark.skipif(shutil.which("systemd-socket-activate") is None, reason="systemd-socket-activate not on PATH")
def test_listen_fds_under_systemd_socket_activate(sock_dir: Path) -> None:
    """The same child, activated by systemd's own tool instead of the trampoline."""
    path = str(sock_dir / "diffusiond.sock")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LISTEN_", "NOTIFY_", "WATCHDOG_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    cmd = [
        "systemd-socket-activate",
        "--listen",
        path,
        "--fdname=diffusiond",
        f"--setenv=PYTHONPATH={env['PYTHONPATH']}",
        sys.executable,
        "-c",
        _SERVER,
    ]
    child = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 20
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.settimeout(20)
            while True:  # the tool binds, then listens: retry until both are done
                try:
                    client.connect(path)
                    break
                except (FileNotFoundError, ConnectionRefusedError):
                    assert child.poll() is None, child.communicate()[1].decode(errors="replace")
                    assert time.monotonic() < deadline, "systemd-socket-activate did not listen"
                    time.sleep(0.02)
            chunks = []
            while chunk := client.recv(65536):
                chunks.append(chunk)
        _, err = child.communicate(timeout=20)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 0, err.decode(errors="replace")
    report = json.loads(b"".join(chunks))
    assert report["names"] == ["diffusiond"]
    assert report["filenos"] == [3]
    assert report["cloexec"] == [True]
    assert report["env_left"] == []


def test_listen_fds_for_another_pid_is_empty(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("LISTEN_FDS", "1")
    clean_env.setenv("LISTEN_PID", str(os.getpid() + 1))
    assert systemd.listen_fds() == []
    # Unset anyway, so processes the daemon starts never see them.
    assert "LISTEN_FDS" not in os.environ
    assert "LISTEN_PID" not in os.environ


def test_listen_fds_keeps_environment_when_asked(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("LISTEN_FDS", "1")
    clean_env.setenv("LISTEN_PID", str(os.getpid() + 1))
    assert systemd.listen_fds(unset_environment=False) == []
    assert os.environ["LISTEN_FDS"] == "1"


@pytest.mark.parametrize(
    ("fds", "pid"),
    [(None, None), ("1", None), (None, "self"), ("x", "self"), ("0", "self"), ("1", "x")],
)
def test_listen_fds_without_activation(fds: str | None, pid: str | None, clean_env: pytest.MonkeyPatch) -> None:
    if fds is not None:
        clean_env.setenv("LISTEN_FDS", fds)
    if pid is not None:
        clean_env.setenv("LISTEN_PID", str(os.getpid()) if pid == "self" else pid)
    assert systemd.listen_fds() == []


def test_import_has_no_side_effects() -> None:
    code = (
        "import os, sys; before = dict(os.environ); "
        "import diffusiond.daemon.systemd; "
        "sys.exit(0 if dict(os.environ) == before else 1)"
    )
    env = {**os.environ, "LISTEN_FDS": "1", "LISTEN_PID": "1", "NOTIFY_SOCKET": "@nowhere"}
    env["PYTHONPATH"] = str(REPO)
    assert subprocess.run([sys.executable, "-c", code], env=env, timeout=30).returncode == 0


# --- unit files --------------------------------------------------------------------------------


def parse_unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """Read a unit file the way systemd does for these purposes: sections, repeated keys kept in
    order, comments and blank lines skipped, backslash continuations joined. configparser cannot
    keep DeviceAllow= repeated, hence this small reader.
    """
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    pending = ""
    for raw in path.read_text().splitlines():
        line = (pending + raw.strip()) if pending else raw.strip()
        pending = ""
        if not line or line[0] in "#;":
            continue
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"{path}: key outside a section: {line!r}"
        key, sep, value = line.partition("=")
        assert sep, f"{path}: not KEY=VALUE: {line!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def _one(section: dict[str, list[str]], key: str) -> str:
    values = section.get(key)
    assert values, f"{key}= missing"
    assert len(values) == 1, f"{key}= set {len(values)} times: {values}"
    return values[0]


def _seconds(value: str) -> float:
    units = {"ms": 0.001, "s": 1, "sec": 1, "min": 60, "m": 60, "h": 3600}
    for suffix, factor in sorted(units.items(), key=lambda item: -len(item[0])):
        if value.endswith(suffix) and value[: -len(suffix)].strip().replace(".", "", 1).isdigit():
            return float(value[: -len(suffix)]) * factor
    return float(value)


@pytest.mark.parametrize("path", [SYSTEM_SERVICE, USER_SERVICE], ids=["system", "user"])
def test_service_unit_settings_the_daemon_relies_on(path: Path) -> None:
    assert path.read_text().startswith("#"), "unit files start with install instructions"
    unit = parse_unit(path)
    service = unit["Service"]
    assert _one(service, "Type") == "notify"
    assert _one(service, "NotifyAccess") == "main"
    assert _one(service, "KillMode") == "mixed"
    assert _seconds(_one(service, "TimeoutStopSec")) > DEFAULT_DRAIN_GRACE_S
    assert _seconds(_one(service, "WatchdogSec")) == 30
    assert _one(service, "Restart") == "on-failure"
    assert _one(service, "RuntimeDirectory") == "diffusiond"
    assert _one(service, "RuntimeDirectoryMode") == "0750"
    assert _one(service, "NoNewPrivileges") == "yes"
    exec_start = _one(service, "ExecStart").split()
    assert exec_start[:3] == ["/usr/bin/env", "diffusiond", "serve"]
    assert exec_start[exec_start.index("--config") + 1].endswith("/diffusiond/config.toml")
    # Both would take the GPU away: no /dev/nvidia* and no W+X memory for the CUDA JIT.
    assert service.get("PrivateDevices", ["no"]) == ["no"]
    assert "MemoryDenyWriteExecute" not in service
    assert "diffusiond.socket" in " ".join(unit["Unit"].get("Requires", []))
    assert "diffusiond.socket" in _one(unit["Install"], "Also")


def test_system_service_hardening_lets_the_gpu_through() -> None:
    service = parse_unit(SYSTEM_SERVICE)["Service"]
    assert _one(service, "User") == "diffusiond"
    assert _one(service, "Group") == "diffusiond"
    assert _one(service, "ExecStart").endswith("--config /etc/diffusiond/config.toml")
    assert _one(service, "DevicePolicy") == "closed"
    allowed = {entry.split()[0]: entry.split()[1] for entry in service["DeviceAllow"]}
    for node in ("char-nvidia*", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset"):
        assert allowed.get(node) == "rw", f"DeviceAllow={node} rw missing"
    # systemd does not glob device paths: "/dev/nvidia*" would be ignored, not allow nvidia0.
    assert not any("*" in node for node in allowed if node.startswith("/dev/"))
    assert set(_one(service, "SupplementaryGroups").split()) == {"video"}
    assert _one(service, "ProtectSystem") == "strict"
    assert _one(service, "ProtectHome") == "read-only"
    assert _one(service, "PrivateTmp") == "yes"
    assert _one(service, "ReadWritePaths") == "/var/cache/diffusiond"
    assert _one(service, "CacheDirectory") == "diffusiond"
    assert _one(service, "StateDirectory") == "diffusiond"
    env = dict(entry.split("=", 1) for entry in service["Environment"])
    assert env["DIFFUSIOND_CACHE"] == "/var/cache/diffusiond"
    assert env["HF_HOME"] == "/var/cache/diffusiond/huggingface"
    assert "ProcSubset" not in service


SYSUSERS_BASIC = Path("/usr/lib/sysusers.d/basic.conf")


@pytest.mark.skipif(not SYSUSERS_BASIC.exists(), reason="no systemd sysusers.d/basic.conf on this machine")
def test_every_supplementary_group_exists_wherever_systemd_does() -> None:
    """systemd fails a unit naming a group the host lacks (216/GROUP, before ExecStart); the groups its
    own basic.conf declares are made on every host it runs on."""
    declared = {line.split()[1] for line in SYSUSERS_BASIC.read_text().splitlines() if line.startswith("g ")}
    named = set(_one(parse_unit(SYSTEM_SERVICE)["Service"], "SupplementaryGroups").split())
    assert named and named <= declared, f"{sorted(named - declared)} not in {SYSUSERS_BASIC}"


def test_user_service_uses_user_paths() -> None:
    service = parse_unit(USER_SERVICE)["Service"]
    assert _one(service, "ExecStart").endswith("--config %h/.config/diffusiond/config.toml")
    # A user manager cannot switch users or filter devices.
    for key in ("User", "Group", "SupplementaryGroups", "DeviceAllow", "DevicePolicy"):
        assert key not in service


@pytest.mark.parametrize(
    ("path", "listen"),
    [
        (SYSTEM_SOCKET, "/run/diffusiond/diffusiond.sock"),
        (USER_SOCKET, "%t/diffusiond/diffusiond.sock"),
    ],
    ids=["system", "user"],
)
def test_socket_unit(path: Path, listen: str) -> None:
    assert path.read_text().startswith("#"), "unit files start with install instructions"
    unit = parse_unit(path)
    sock = unit["Socket"]
    assert _one(sock, "ListenStream") == listen
    assert _one(sock, "SocketMode") == "0660"
    assert _one(sock, "Service") == "diffusiond.service"
    assert _one(sock, "DirectoryMode")
    assert sock.get("Accept", ["no"]) == ["no"], "one daemon serves every connection"
    assert _one(unit["Install"], "WantedBy") == "sockets.target"
    if path == SYSTEM_SOCKET:
        assert _one(sock, "SocketGroup") == "diffusiond"


def test_system_socket_lives_in_the_service_runtime_directory() -> None:
    listen = _one(parse_unit(SYSTEM_SOCKET)["Socket"], "ListenStream")
    runtime = _one(parse_unit(SYSTEM_SERVICE)["Service"], "RuntimeDirectory")
    assert Path(listen).parent == Path("/run") / runtime
    # Otherwise stopping the service deletes the directory, and the socket with it, while the
    # socket unit still listens: the next client gets "no such file".
    assert _one(parse_unit(SYSTEM_SERVICE)["Service"], "RuntimeDirectoryPreserve") == "yes"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not on PATH")
@pytest.mark.parametrize(
    ("units", "user"),
    [((SYSTEM_SERVICE, SYSTEM_SOCKET), False), ((USER_SERVICE, USER_SOCKET), True)],
    ids=["system", "user"],
)
def test_systemd_analyze_verify(units: tuple[Path, Path], user: bool, tmp_path: Path) -> None:
    # The user manager resolves %t from XDG_RUNTIME_DIR; give it one that exists.
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path), "SYSTEMD_LOG_COLOR": "0"}
    cmd = ["systemd-analyze", *(["--user"] if user else []), "verify", *map(str, units)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    # Unknown keys and bad values are only warnings on stderr; treat them as failures too.
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr
