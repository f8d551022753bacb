"""The state dir: one daemon at a time, and a database that is ours or a clear refusal.

Two daemons writing one database and one outputs folder would each believe they own every
queued job and run it twice; so the first takes an exclusive ``flock`` on ``lock`` (released by
the kernel when the process dies, even by SIGKILL, so a crash never leaves a stale lock) and
writes its pid there, which the second names when it refuses to start.

A database that is not ours (another program's SQLite file, a truncated file, random bytes)
stops the start with its path: silently starting empty would look like every job vanished.
``--reset-state`` moves it aside (kept, renamed, never deleted) and starts afresh.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from pathlib import Path


class StateDirError(Exception):
    """The state dir cannot be used; the message says which file and what to do."""


class StateLock:
    """An exclusive lock on ``DIR/lock`` holding this process's pid, for as long as the daemon runs."""

    def __init__(self, root: Path) -> None:
        self.path = root / "lock"
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise StateDirError(
                f"the state dir {self.path.parent} is in use by another diffusiond (pid {holder}); stop it, or give "
                "this one its own --state-dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last fd drops the flock
            self._fd = None


def prepare(root: Path) -> None:
    """Create the state dir (0700: prompts and outputs are the user's) and its outputs folder."""
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        (root / "outputs").mkdir(mode=0o700, exist_ok=True)
    except OSError as exc:
        raise StateDirError(f"cannot create the state dir {root}: {exc.strerror}; choose another --state-dir, "
                            "or --no-persist") from None
    if not os.access(root, os.W_OK | os.X_OK):
        raise StateDirError(f"the state dir {root} is not writable by uid {os.getuid()}; choose another --state-dir")


def move_aside(db: Path) -> Path:
    """Rename a bad database (and its WAL files) to ``jobs.db.bad-<time>``; return the new name."""
    stamp = time.strftime("%Y%m%dT%H%M%S")
    target = db.with_name(f"{db.name}.bad-{stamp}")
    for suffix in ("", "-wal", "-shm"):
        with contextlib.suppress(FileNotFoundError):
            os.replace(f"{db}{suffix}", f"{target}{suffix}")
    return target
