"""Shared fixtures. Everything here runs real processes and real sockets; nothing is mocked."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def shm_entries() -> set[str]:
    """Names in /dev/shm: memfd-backed memory must never appear here."""
    try:
        return set(os.listdir("/dev/shm"))
    except FileNotFoundError:
        return set()


def memfd_maps(pid: int | str = "self") -> list[str]:
    """memfd mappings of a process, from /proc/PID/maps."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return [line for line in f if "memfd:" in line]
    except FileNotFoundError:
        return []


@pytest.fixture(scope="session", autouse=True)
def state_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Daemons that tests start without a --state-dir keep their jobs here, never in the
    user's real ~/.local/state (tests/daemonkit.py gives each daemon its own)."""
    path = tmp_path_factory.mktemp("state-home")
    os.environ["XDG_STATE_HOME"] = str(path)
    os.environ.pop("STATE_DIRECTORY", None)
    return path


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache folder for the embedded models for the whole run (tiny is built once)."""
    path = Path(os.environ.get("DIFFUSIOND_TEST_CACHE") or tmp_path_factory.mktemp("model-cache"))
    os.environ["DIFFUSIOND_CACHE"] = str(path)
    return path



def pytest_asyncio_loop_factories(config, item):  # type: ignore[no-untyped-def]
    """The daemon runs on uvloop; so do the async tests."""
    import uvloop

    return {"uvloop": uvloop.new_event_loop}


@pytest.fixture
def daemon_factory(tmp_path: Path, model_cache: Path):  # type: ignore[no-untyped-def]
    """Start real daemons: ``daemon_factory("--model", "tiny", ...)``; all stopped at teardown."""
    from daemonkit import Daemon

    started: list[Daemon] = []

    def make(*args: str, env: dict[str, str] | None = None, start: bool = True,
             socket_dir: Path | None = None) -> Daemon:
        n = len(started)
        d = Daemon((socket_dir or tmp_path) / f"d{n}.sock", list(args), tmp_path / f"d{n}.log",
                   env={"DIFFUSIOND_CACHE": str(model_cache), **(env or {})})
        started.append(d)
        if start:
            d.start()
        return d

    yield make
    for d in started:
        d.stop()


@pytest.fixture
def daemon(daemon_factory):  # type: ignore[no-untyped-def]
    """A daemon on tiny with two CPU workers, batching up to 4."""
    return daemon_factory("--model", "tiny", "--workers", "2", "--max-batch", "4", "--job-timeout", "120")
