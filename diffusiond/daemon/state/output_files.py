"""The state dir's output files: written atomically, and swept of those no record lists.

Apart from ``store.py``, which keeps the records (the file names they list), because these run on the encode pool's
threads (a write) or once at start (the sweep) and touch only files.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sqlite3
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from diffusiond.daemon.state.faults import StateFaults
from diffusiond.daemon.state.statedir import fsync_dir

log = logging.getLogger(__name__)

_OUTPUT_NAME = re.compile(r"j_[0-9a-f]+-\d+\..+")  # <job>-<k>.<ext> and <job>-<k>.<array>.npy, never a .tmp


def write(outputs_dir: Path, name: str, parts: Sequence[bytes | memoryview], faults: StateFaults) -> int:
    """``parts`` as ``outputs_dir/name``, whole or not at all (a temporary file, fsynced, then renamed); its size.
    An OSError (a full disk) leaves no temporary file behind."""
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=outputs_dir)
    size = 0
    try:
        with os.fdopen(fd, "wb") as f:
            for part in parts:
                faults.check_space()
                view = memoryview(part).cast("B")
                if faults.write_delay_ms:
                    half = len(view) // 2
                    f.write(view[:half])
                    f.flush()
                    time.sleep(faults.write_delay_ms / 1000)
                    view = view[half:]
                f.write(view)
                size += len(part) if isinstance(part, bytes) else part.nbytes
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, outputs_dir / name)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(outputs_dir)
    return size


def sweep(outputs_dir: Path, finished: Sequence[sqlite3.Row | tuple[str, str]]) -> int:
    """Files a record does not list are never served, deleted or counted by --keep-gb: a job's file written
    as it was cancelled (older diffusiond), a row deleted while its file was being written, a first run's
    output whose job is about to run again from the start. Only the listed files of the
    ``finished`` jobs' (id, outputs) are kept; a row whose outputs do not read keeps every file named for it."""
    keep: set[str] = set()
    unread: list[str] = []
    for job_id, outputs in finished:
        try:
            for out in json.loads(outputs):
                keep.add(out["file"])
                keep.update(f["file"] for f in (out.get("trajectory") or {}).values())
        except (ValueError, TypeError, KeyError, AttributeError):
            unread.append(f"{job_id}-")
    removed = 0
    for path in outputs_dir.iterdir():
        name = path.name
        if _OUTPUT_NAME.fullmatch(name) and name not in keep and not name.startswith(tuple(unread)):
            path.unlink(missing_ok=True)
            removed += 1
    if removed:
        log.info("removed %d file(s) from %s that no finished job's record lists (left by a crash, or by a "
                 "job that ended while its output was written)", removed, outputs_dir)
    return removed
