"""The state dir: one daemon at a time, and a database that is ours or a clear refusal.

Two daemons writing one database and one outputs folder would each believe they own every
queued job and run it twice; so the first takes an exclusive ``flock`` on ``lock`` (released by
the kernel when the process dies, even by SIGKILL, so a crash never leaves a stale lock) and
writes its pid there, which the second names when it refuses to start.

A database that is not ours (another program's SQLite file, a truncated file, random bytes)
stops the start with its path: silently starting empty would look like every job vanished.
``--reset-state`` moves it aside (kept, renamed, never deleted) and starts afresh. Only a file that
is not ours is: a database SQLite cannot open for another reason (a full disk, a file of another
user, a lock held by another program) is good, and moving it aside would hide every job it holds,
so those stop the start with what to do instead (``start_problem``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import sqlite3
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
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:  # e.g. left behind by a run under sudo
            raise StateDirError(f"cannot open {self.path}: {exc.strerror}; {_fix(self.path, exc)}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise StateDirError(
                f"the state dir {self.path.parent} is in use by another diffusiond (pid {holder}); stop it, or give "
                "this one its own --state-dir") from None
        with contextlib.suppress(OSError):  # the pid only names the holder: a full disk must not stop the start here
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
    # its files too: one the daemon cannot write fails later, deep in SQLite or at the first output
    for path in (root / "lock", root / "outputs", *(root / f"jobs.db{s}" for s in ("", "-wal", "-shm"))):
        if problem := unwritable(path):
            raise StateDirError(problem)


def unwritable(path: Path) -> str | None:
    """Why the daemon cannot write ``path`` (with what to do), or None: it can, or it does not exist."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot read {path}: {exc.strerror}; {_fix(path, exc)}"
    if os.access(path, os.W_OK | (os.X_OK if path.is_dir() else 0)):
        return None
    if st.st_uid != os.getuid():
        return f"{path} is not writable by uid {os.getuid()} (it belongs to uid {st.st_uid}); {_chown(path.parent)}"
    return (f"{path} is not writable by uid {os.getuid()} (mode {st.st_mode & 0o777:o}, or a read-only mount); make "
            "it writable")


def _chown(state_dir: Path) -> str:
    uid = os.getuid()
    return f"the state dir's files must belong to uid {uid}, the daemon's user: chown -R {uid} {state_dir}"


def _fix(path: Path, exc: OSError) -> str:
    if exc.errno in (errno.EACCES, errno.EPERM):
        return _chown(path.parent)
    if exc.errno == errno.EROFS:
        return "it is on a read-only mount: choose another --state-dir"
    return "move it away, or choose another --state-dir"


# SQLite's primary result codes (the low byte of an extended one), as Python 3.11's sqlite3 names them
_NOT_OURS = {sqlite3.SQLITE_NOTADB, sqlite3.SQLITE_CORRUPT}
_NO_SPACE = {sqlite3.SQLITE_FULL, sqlite3.SQLITE_IOERR}
_NO_ACCESS = {sqlite3.SQLITE_READONLY, sqlite3.SQLITE_CANTOPEN, sqlite3.SQLITE_PERM}
_IN_USE = {sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED}


class ForeignDatabase(sqlite3.DatabaseError):
    """A file SQLite reads that is not ours: another program's tables, or a failed integrity check."""


def start_problem(db: Path, exc: sqlite3.Error) -> StateDirError | None:
    """What stops SQLite from opening a good ``db`` at start, as a refusal saying what to do; None where the
    file itself is not a diffusiond database (what ``--reset-state`` is for). Decided by SQLite's own code,
    never by its message."""
    code = getattr(exc, "sqlite_errorcode", None)
    if isinstance(exc, ForeignDatabase) or (code is not None and code & 0xFF in _NOT_OURS):
        return None
    primary = None if code is None else code & 0xFF
    where = db.parent
    if primary in _NO_SPACE:
        free = _free_bytes(where)
        if primary == sqlite3.SQLITE_FULL or (free is not None and free < 1 << 20):
            return StateDirError(
                f"the disk holding the state dir {where} is full ({_size(free)} free): {db.name} cannot be opened "
                f"({exc}); free space there and start again (the database is kept as it is: do not --reset-state)")
        return StateDirError(f"{db} cannot be read or written ({exc}, {_size(free)} free): check the disk holding "
                             f"{where} (dmesg); the database is kept as it is")
    if primary in _NO_ACCESS:
        for path in (db, *(db.with_name(f"{db.name}{s}") for s in ("-wal", "-shm"))):
            if problem := unwritable(path):
                return StateDirError(f"{problem} ({exc})")
        if db.exists() and not db.is_file():
            return StateDirError(f"{db} is not a file ({exc}): move it away")
        return StateDirError(f"{db} cannot be opened for writing by uid {os.getuid()} ({exc}); {_chown(where)}")
    if primary in _IN_USE:
        return StateDirError(f"another process holds {db} open ({exc}); stop it (fuser {db} names it) and start again")
    return StateDirError(f"{db} cannot be opened ({exc}; SQLite code {code}); the database is kept as it is")


def _free_bytes(path: Path) -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _size(n: int | None) -> str:
    if n is None:
        return "unknown space"
    return f"{n / (1 << 20):.1f} MiB" if n >= 1 << 20 else f"{n // 1024} KiB"


def move_aside(db: Path) -> Path:
    """Rename a bad database (and its WAL files) to ``jobs.db.bad-<time>``; return the new name."""
    stamp = time.strftime("%Y%m%dT%H%M%S")
    target = db.with_name(f"{db.name}.bad-{stamp}")
    for suffix in ("", "-wal", "-shm"):
        with contextlib.suppress(FileNotFoundError):
            os.replace(f"{db}{suffix}", f"{target}{suffix}")
    return target


def disk_full(exc: BaseException) -> bool:
    """A write failed because the disk (or the user's quota) is full."""
    return (isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)) or (
        isinstance(exc, sqlite3.Error) and (getattr(exc, "sqlite_errorcode", None) or 0) & 0xFF == sqlite3.SQLITE_FULL)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
