"""Who runs which store in a state dir that all replicas share: flocks and markers, no Ray.

With ``shared_state_dir=ROOT`` each replica's daemon keeps its jobs in ``ROOT/<store>/`` (the
store is named after the replica). Whoever runs a store's daemon holds an exclusive ``flock`` on
``ROOT/<store>/adopt.lock`` for as long as it lives, and hands the same open file to that
daemon (``pass_fds``), so the lock is free only once the replica *and* its daemon are gone: a
flock dies with the last process that holds it, even by SIGKILL or a lost node, which is exactly
the signal that the store's jobs have no one to run them. No heartbeat, no clock, no table to
keep in step.

A replica that finds such a free lock takes it (``LOCK_NB``: of two that race, one wins and the
other sees it held) and writes ``adopted.json`` naming itself; it then runs that store's daemon,
which resumes the queued and running jobs as after a crash on one machine. The marker outlives
the adopter: a replica that comes back under the id of an adopted store (Serve never reuses ids,
but a store must be safe against it) does not open that store again, it takes a fresh one
(``<id>-2``, ...), so the adopted jobs never run twice.

Why flock and not a lease in the database: a lease needs clocks that agree and a period to wait
out; a flock is released by the kernel the moment its holder is gone. On a network file system
the volume must give ``flock`` its meaning across machines (NFSv4 with ``local_lock=none``, CephFS,
a ReadWriteMany volume of a CSI driver with POSIX locks); docs/scaling.md says so.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("diffusiond.ray")

LOCK = "adopt.lock"
MARKER = "adopted.json"
DAEMON_LOCK = "lock"  # the daemon's own state lock (daemon/state/statedir.py)
DB = "jobs.db"
LIVE = ("queued", "running")


class Claim:
    """An exclusive flock on one store's ``adopt.lock``, held until ``release`` or the process ends.

    The descriptor is close-on-exec: it reaches the store's daemon only through ``pass_fds``, and
    no other child of the replica keeps the lock alive."""

    def __init__(self, store: str, fd: int) -> None:
        self.store = store
        self.fd = fd

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def try_claim(root: Path, store: str) -> Claim | None:
    """The store's lock if no one holds it, else None (its owner or an adopter is alive)."""
    d = root / store
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(d / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except OSError:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return Claim(store, fd)


def daemon_lock_free(root: Path, store: str) -> bool:
    """Whether no daemon holds the store's own state lock: a daemon started without our lock's
    descriptor (by hand, or an older diffusiond) may outlive its replica; its store is not free."""
    path = root / store / DAEMON_LOCK
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # drops the probe's lock too
    return True


@dataclass(frozen=True)
class Marker:
    by: str
    at: float
    failed: str | None = None


def read_marker(root: Path, store: str) -> Marker | None:
    try:
        doc: Any = json.loads((root / store / MARKER).read_text())
        return Marker(str(doc["by"]), float(doc.get("at", 0.0)), doc.get("failed"))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_marker(root: Path, store: str, by: str, failed: str | None = None) -> None:
    """Written whole and renamed over, so a reader sees the old marker or the new one, never half."""
    path = root / store / MARKER
    tmp = path.with_name(f".{MARKER}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"by": by, "at": time.time(), "failed": failed}))
    os.replace(tmp, path)


def claim_own(root: Path, replica: str, most: int = 100) -> Claim:
    """The store a replica starting under ``replica`` runs its own daemon on: ``replica`` itself
    unless that store was adopted (a marker) or is held (another process under the same id);
    then ``replica-2``, ``replica-3``, ... so adopted jobs are never run a second time."""
    for n in range(1, most + 1):
        store = replica if n == 1 else f"{replica}-{n}"
        if read_marker(root, store) is not None:
            continue
        claim = try_claim(root, store)
        if claim is None:
            continue
        if read_marker(root, store) is not None:  # adopted between the look and the lock
            claim.release()
            continue
        return claim
    raise RuntimeError(f"{root}: the stores {replica} to {replica}-{most} are all adopted or held; "
                       "clean up the shared state dir")


def unfinished(root: Path, store: str) -> int:
    """Jobs the store's database holds queued or running; -1 when it cannot be read (a daemon on
    it then says why, and the job ends with that reason)."""
    db = root / store / DB
    if not db.exists():
        return 0
    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
        try:
            n = con.execute(f"SELECT count(*) FROM jobs WHERE status IN {LIVE}").fetchone()[0]
        finally:
            con.close()
        return int(n)
    except sqlite3.Error:
        return -1


def stores(root: Path) -> list[str]:
    """Every store in the shared state dir (a folder with an ``adopt.lock``)."""
    with contextlib.suppress(OSError):
        return sorted(p.parent.name for p in root.glob(f"*/{LOCK}"))
    return []


def adopt(root: Path, store: str, me: str) -> Claim | None:
    """Take a gone replica's store for ``me``: its lock, then the marker naming ``me``; None if
    someone holds it, or its daemon still runs."""
    claim = try_claim(root, store)
    if claim is None:
        return None
    try:
        if not daemon_lock_free(root, store):
            claim.release()
            return None
        write_marker(root, store, me)
    except OSError:
        claim.release()  # held with no daemon on it, the store would be no one's for this replica's life
        raise
    return claim


def scan(root: Path, me: str, held: set[str]) -> list[Claim]:
    """Adopt every store not in ``held`` whose owner is gone and that has jobs to run again.
    Stores with only finished jobs are left for a request that names one (``adopt`` then): their
    outputs are read on demand, and a daemon is not started for each old store at every start."""
    taken = []
    for store in stores(root):
        try:
            if store in held or unfinished(root, store) == 0:
                continue
            claim = adopt(root, store, me)
        except OSError as exc:  # a store this replica cannot open (another owner's files, a bad volume) stops no other
            log.warning("replica %s skips store %s of the shared state dir %s: %s; fix its permissions or remove it",
                        me, store, root, exc)
            continue
        if claim is not None:
            taken.append(claim)
    return taken
