"""Opening the state database: a connection to a file that is ours, whole and at the current schema, or a clear
refusal; and the start's ending of unfinished jobs whose record does not read.

Apart from ``store.py`` (the one thread, the job calls, the files) because this runs once, at start, and holds the
whole decision of what the start does with the file it finds: create it, use it, refuse it with what to do, or (only
with ``--reset-state``, and only a file that is not ours) move it aside. Every function here runs in the store's
thread, as the rest of its database work does.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import time
from pathlib import Path

from diffusiond.daemon.state.rows import APPLICATION_ID, SCHEMA, SCHEMA_VERSION
from diffusiond.daemon.state.statedir import ForeignDatabase, StateDirError, move_aside, start_problem
from diffusiond.protocol import ErrorCode, JobStatus

log = logging.getLogger(__name__)

LIVE = (JobStatus.QUEUED.value, JobStatus.RUNNING.value)  # a record in one of these runs again at the next start


def open_database(db_path: Path, *, reset: bool, sync: str) -> sqlite3.Connection:
    """The state database at ``db_path``; ``sync`` is ``normal`` or ``full`` (``--state-sync``)."""
    try:
        return _connect(db_path, sync)
    except sqlite3.Error as exc:
        # a good database SQLite cannot open now (full disk, owner, lock) is never moved aside: it holds every job
        if (problem := start_problem(db_path, exc)) is not None:
            raise problem from None
        if not reset:
            raise StateDirError(
                f"{db_path} is not a diffusiond state database ({exc}); move it away, or start with "
                "--reset-state to have it moved aside") from None
        aside = move_aside(db_path)
        log.warning("moved the unreadable state database %s aside to %s (%s)", db_path, aside, exc)
        try:
            return _connect(db_path, sync)
        except sqlite3.Error as again:
            raise (start_problem(db_path, again) or StateDirError(
                f"a new state database {db_path} could not be made ({again})")) from None


def _connect(db_path: Path, sync: str) -> sqlite3.Connection:
    con = sqlite3.connect(db_path, isolation_level=None, check_same_thread=False)
    try:
        con.row_factory = sqlite3.Row
        app = con.execute("PRAGMA application_id").fetchone()[0]
        tables = [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        if app != APPLICATION_ID and tables:
            raise ForeignDatabase(f"it holds tables {', '.join(tables)} and no diffusiond mark")
        if app == APPLICATION_ID:
            check = con.execute("PRAGMA quick_check").fetchone()[0]
            if check != "ok":
                raise ForeignDatabase(f"integrity check: {check}")
        con.execute("PRAGMA journal_mode = WAL")
        # NORMAL: a commit is in the WAL (the OS has it) before the 202: it survives any crash of the
        # daemon. FULL also fsyncs each commit: a 202 means the job survives a power cut too, at ~2 ms per job here.
        con.execute(f"PRAGMA synchronous = {sync.upper()}")
        con.executescript(SCHEMA)
        con.execute(f"PRAGMA application_id = {APPLICATION_ID}")
        con.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
    except BaseException:
        con.close()
        raise
    return con


def unfinished(con: sqlite3.Connection) -> list[sqlite3.Row]:
    """The records a crash (or a stop) left live, in admission order: the queue's order after a restart."""
    return con.execute(f"SELECT * FROM jobs WHERE status IN {LIVE} ORDER BY seq").fetchall()


def fail_unreadable(con: sqlite3.Connection, db_path: Path, ids: list[str]) -> None:
    """End failed the unfinished jobs whose record does not read: such a job cannot run again, and left live it
    would warn at every later start."""
    error = {"code": str(ErrorCode.STATE_FAILED), "stage": "queued",
             "message": f"the record of this job in {db_path} does not read, so it cannot run again after "
                        "the restart: submit it again"}
    for job_id in ids:
        con.execute(f"UPDATE jobs SET status = ?, error = ?, ended = ? WHERE id = ? AND status IN {LIVE}",
                    (JobStatus.FAILED.value, json.dumps(error), time.time(), job_id))
        log.warning("job %s was accepted by the last run and did not finish, but its record in %s does not read: "
                    "it is ended failed (state_failed)", job_id, db_path)
