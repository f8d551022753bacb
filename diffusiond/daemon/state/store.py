"""Durable jobs: every accepted job, its status and its outputs, kept in the state dir.

The engine keeps its jobs in memory and tells one collaborator, the store, what happened to
them: ``add`` (awaited before the 202 goes out, so an accepted job is on disk), ``update``
(started, ended: written in order; it returns the write's future, which the engine waits for
before it tells anyone a job ended), ``write_output`` (an output's encoded
bytes, in the encode pool) and, at start, ``open`` (the jobs a crash interrupted). ``Store``
itself does nothing: it is ``--no-persist`` and what the engine tests use. ``SqliteStore`` keeps
them in ``DIR/jobs.db`` (SQLite, WAL; commits fsynced with ``--state-sync full``) and ``DIR/outputs/``.

Why one thread: sqlite3 connections are not to be shared between threads, and the event loop
must never wait for a disk. A single-thread executor is that thread and its queue: statements
run one at a time in the order the loop sent them, so an update can never overtake the insert
of the same job, and each call gives the loop a future.

What a row holds, and why the request is msgspec JSON, is ``rows.py``'s; what the start does with the file it
finds (use it, make it, refuse it, move it aside) is ``database.py``'s. Output files are
written whole to a temp file, fsynced, renamed over their final name (``<job>-<k>.<ext>``, so
a second run of a job replaces its file and never makes a second one) and the folder fsynced:
a file under its final name is always complete.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sqlite3
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from diffusiond.daemon.core.jobs import Job
from diffusiond.daemon.errors import InsufficientStorage, NotAccepting, StateWriteFailed
from diffusiond.daemon.state import database, output_files
from diffusiond.daemon.state.database import LIVE
from diffusiond.daemon.state.faults import StateFaults
from diffusiond.daemon.state.rows import UnreadableRow, from_row, row_id, to_row
from diffusiond.daemon.state.statedir import StateLock, disk_full, prepare
from diffusiond.ipc.messages import Capabilities
from diffusiond.protocol import ErrorCode

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class Page:
    """One page of history, newest first; ``next_before`` continues it (None: the last page)."""

    jobs: list[Job]
    next_before: str | None


class Store:
    """Jobs kept in memory only (``--no-persist``, engine tests): every hook does nothing."""

    persistent = False
    root: Path | None = None
    outputs_dir: Path | None = None  # where the output files lie (SqliteStore); the one place that says so
    lost_inputs: frozenset[str] = frozenset()  # unfinished edits from ``open``: their input images were not kept

    async def open(self) -> list[Job]:
        """Take the state dir; return the jobs a crash left unfinished, in admission order."""
        return []

    async def capabilities(self) -> dict[str, Capabilities]:
        """What each model said of itself when it last loaded: a request that comes while it
        loads again is completed with its own defaults without waiting for it."""
        return {}

    def remember(self, model: str, capabilities: Capabilities) -> None:
        """Keep what a model said of itself (its READY) for the next start."""

    async def working_memory(self) -> dict[str, Any]:
        """The working memory each model's runs were measured at (residency/working.py's entries), so a
        restarted daemon plans with measurements instead of its conservative default."""
        return {}

    def remember_working(self, model: str, entry: Mapping[str, Any]) -> None:
        """Keep a model's measured working memory (all its shapes) for the next start."""

    async def add(self, job: Job) -> None:
        """Record a newly admitted job; returns once it is on disk."""

    def update(self, job: Job) -> asyncio.Future[None] | None:
        """Record a job's new status (started, ended), written in order; the write's future (its
        error a domain error), or None where nothing is written."""
        return None

    async def load(self, job_id: str) -> Job | None:
        """A job that is no longer in memory, from disk."""
        return None

    async def page(self, status: str | None, model: str | None, before: str | None, limit: int) -> Page:
        return Page([], None)

    async def delete(self, job: Job) -> None:
        """Forget a finished job: its record, then its files."""

    async def expired(self, keep_days: float, keep_bytes: int) -> list[Job]:
        """Finished jobs past the retention limits, oldest first."""
        return []

    def write_output(self, job_id: str, index: int, ext: str, parts: Sequence[bytes | memoryview]) -> tuple[str, int]:
        """Write one output atomically (called in the encode pool); its file name and size."""
        raise NotImplementedError("outputs are not written when jobs are not persisted")

    def read_output(self, name: str) -> bytes:
        raise FileNotFoundError(name)

    def discard_outputs(self, names: Sequence[str]) -> None:
        """Unlink files just written for a job that ended meanwhile: its record lists none of them."""

    async def sweep_outputs(self) -> int:
        """At start, before any job runs: remove the output files no finished job's record lists; how many."""
        return 0

    async def close(self) -> None:
        """Let the state dir go once what is pending is written. Here nothing is kept, so nothing changes: reads
        still answer "nothing kept" and the edge answers from the engine's memory (an unknown job is a 404, as it
        is after a restart, where a 503's "ask again" would promise a job that never comes back). ``SqliteStore``
        refuses every call from its close on as the shutdown (503)."""


class SqliteStore(Store):
    persistent = True

    def __init__(self, root: str | Path, *, reset: bool = False, faults: str = "", sync: str = "normal") -> None:
        self.dir = self.root = Path(root)
        self.db_path = self.dir / "jobs.db"
        self.outputs_dir: Path = self.dir / "outputs"
        self.reset = reset
        self.sync = sync  # "normal" or "full" (config.STATE_SYNC)
        self.faults = StateFaults.parse(faults)
        self._lock = StateLock(self.dir)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="state-db")
        self._con: sqlite3.Connection | None = None  # None until open, and again once closed
        self._pending: set[asyncio.Future[Any]] = set()
        self._closing = False  # from close's start on, every call is refused (``_submit``)
        # Endings whose write failed (a full disk), by job id, touched by the store's thread alone: each is written anew
        # after the next write that succeeds and at close, or a restart runs a job its client saw end.
        self._unwritten: dict[str, dict[str, Any]] = {}
        self._unreadable: set[str] = set()  # rows already warned of: a page read every second warns once

    # the one thread ---------------------------------------------------------------------------
    def _submit(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """``fn`` queued in the store's thread, behind what is already there. Refused once close has begun: the HTTP
        server answers until the engine has stopped, and a call then is the shutdown's 503, where the thread, shut
        or about to close the connection, would make it a 500. What was queued before still runs, in order."""
        if self._closing:
            raise NotAccepting("the daemon is shutting down; ask again once it is back", code=ErrorCode.SHUTTING_DOWN)
        return asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await self._submit(fn, *args)

    def _db(self) -> sqlite3.Connection:
        assert self._con is not None, "the store is not open"
        return self._con

    def _failure(self, exc: Exception, what: str) -> Exception:
        """The domain error for a failed write: a full disk names the state dir (507)."""
        if disk_full(exc):
            return InsufficientStorage(f"the disk holding the state dir {self.root} is full: could not {what}; free "
                                       "space there (or lower --keep-gb / --keep-days) and retry")
        return StateWriteFailed(f"could not {what} in the state dir {self.root}: {exc}")

    # start --------------------------------------------------------------------------------------
    async def open(self) -> list[Job]:
        prepare(self.dir)
        self._lock.acquire()
        try:
            rows = await self._run(self._open)
            jobs = [(r, self._decode(r)) for r in rows]
            # an unfinished job whose record does not read cannot run again; ended here, so that it does not stop
            # this start nor warn at every later one
            unreadable = [r["id"] for r, j in jobs if j is None]
            await self._run(database.fail_unreadable, self._db(), self.db_path, unreadable)
        except BaseException:
            self._lock.release()
            raise
        self.lost_inputs = frozenset(r["id"] for r, j in jobs if j is not None and r["edit"])
        return [j for _, j in jobs if j is not None]

    def _open(self) -> list[sqlite3.Row]:
        for leftover in self.outputs_dir.glob(".*.tmp"):  # a write a crash cut short: never served
            leftover.unlink(missing_ok=True)
        self._con = database.open_database(self.db_path, reset=self.reset, sync=self.sync)
        return database.unfinished(self._con)

    def _decode(self, row: sqlite3.Row) -> Job | None:
        """The job a row holds, or None (logged once) where it does not decode: damage inside a value, which
        ``quick_check`` does not see, or a status a newer diffusiond wrote. One such row must not stop a start
        or make every history page that holds it a 500."""
        try:
            return from_row(row)
        except UnreadableRow as exc:
            job_id = row_id(row)
            if job_id not in self._unreadable:
                self._unreadable.add(job_id)
                log.warning("the record of job %s in %s does not read (%s); it is left out of the history",
                            job_id, self.db_path, exc)
            return None

    # models -------------------------------------------------------------------------------------
    async def capabilities(self) -> dict[str, Capabilities]:
        rows = await self._run(lambda: self._db().execute("SELECT name, capabilities FROM models").fetchall())
        out = {}
        for name, caps in rows:
            with contextlib.suppress(msgspec.ValidationError, msgspec.DecodeError):  # an older shape: wait for READY
                # a row an older diffusiond wrote lacks the fields added since; their defaults are not the model's
                # own (min_steps 1 would admit a step count it makes NaN of), so it too waits for READY
                if set(Capabilities.__struct_fields__) <= msgspec.json.decode(caps, type=dict[str, Any]).keys():
                    out[name] = msgspec.json.decode(caps, type=Capabilities)
        return out

    def remember(self, model: str, capabilities: Capabilities) -> None:
        caps = msgspec.json.encode(capabilities).decode()
        self._later(self._db_execute, "INSERT OR REPLACE INTO models (name, capabilities) VALUES (?, ?)", (model, caps))

    async def working_memory(self) -> dict[str, Any]:
        rows = await self._run(lambda: self._db().execute("SELECT name, peaks FROM working").fetchall())
        out = {}
        for name, peaks in rows:
            try:
                out[name] = json.loads(peaks)  # checked where it is read (Measurements.load)
            except ValueError:
                log.warning("the remembered working memory of %s in %s does not read; it is measured again",
                            name, self.db_path)
        return out

    def remember_working(self, model: str, entry: Mapping[str, Any]) -> None:
        self._later(self._db_execute, "INSERT OR REPLACE INTO working (name, peaks) VALUES (?, ?)",
                    (model, json.dumps(entry)))

    def _db_execute(self, sql: str, params: tuple[Any, ...]) -> None:
        self._db().execute(sql, params)

    def _later(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future[None] | None:
        """Run ``fn`` in the store's thread after what is already queued; log a failure."""
        try:
            # submitted now, not from a task that starts later: the thread runs writes in call order
            fut = self._submit(self._then_retry, fn, *args)
        except NotAccepting:  # the daemon is stopping: a late change (a job failed by the shutdown) is not kept
            log.warning("the state database %s is closing: a late change to a job or model was not recorded",
                        self.db_path)
            return None
        self._pending.add(fut)
        fut.add_done_callback(self._updated)
        return fut

    def _then_retry(self, fn: Callable[..., Any], *args: Any) -> None:
        """``fn``, then (it succeeded: the disk takes writes again) the endings that could not be written."""
        fn(*args)
        if self._unwritten:
            self._write_unwritten()

    def _write_unwritten(self) -> None:
        for job_id, row in list(self._unwritten.items()):
            try:
                self._update(row)
            except (OSError, sqlite3.Error) as exc:
                log.warning("the end of job %s is still not recorded in %s (%s)", job_id, self.db_path, exc)
                return
            del self._unwritten[job_id]
            log.info("recorded the end of job %s (%s) in %s, which had failed before", job_id, row["status"],
                     self.db_path)

    # jobs ---------------------------------------------------------------------------------------
    async def add(self, job: Job) -> None:
        row = to_row(job)
        try:
            await self._run(self._then_retry, self._insert, row)
        except (OSError, sqlite3.Error) as exc:
            raise self._failure(exc, f"record job {job.id}") from None

    def _insert(self, row: dict[str, Any]) -> None:
        self.faults.check_space()
        names = ", ".join(row)
        self._db().execute(f"INSERT INTO jobs ({names}) VALUES ({', '.join(':' + k for k in row)})", row)

    def update(self, job: Job) -> asyncio.Future[None] | None:
        return self._later(self._record, to_row(job))

    def _updated(self, fut: asyncio.Future[Any]) -> None:
        self._pending.discard(fut)
        if not fut.cancelled() and fut.exception() is not None:
            log.error("could not write to %s: %s", self.db_path, fut.exception())

    def _record(self, row: dict[str, Any]) -> None:
        try:
            self._update(row)
        except (OSError, sqlite3.Error) as exc:
            if row["status"] in LIVE:  # a start not recorded: the job runs again after a crash, as it would anyway
                raise self._failure(exc, f"record that job {row['id']} started") from None
            self._unwritten[row["id"]] = row
            raise self._failure(exc, f"record that job {row['id']} ended ({row['status']}); it stays "
                                f"{row['status']} here and is recorded after the next write that succeeds, but "
                                "a restart before that runs it again") from None

    def _update(self, row: dict[str, Any]) -> None:
        # Only a live record moves: a job ends once, across restarts too.
        self.faults.check_space()
        if self.faults.update_delay_ms:
            time.sleep(self.faults.update_delay_ms / 1000)
        sets = ", ".join(f"{k} = :{k}" for k in row if k not in ("id", "created", "model", "request", "seeds"))
        self._db().execute(f"UPDATE jobs SET {sets} WHERE id = :id AND status IN {LIVE}", row)

    async def load(self, job_id: str) -> Job | None:
        row = await self._run(self._get, job_id)
        return None if row is None else self._decode(row)

    def _get(self, job_id: str) -> sqlite3.Row | None:
        row: sqlite3.Row | None = self._db().execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return row

    async def page(self, status: str | None, model: str | None, before: str | None, limit: int) -> Page:
        jobs: list[Job] = []
        while True:  # more than once only where a row does not decode: it is left out, and the page filled on
            rows = await self._run(self._page, status, model, before, limit - len(jobs) + 1)
            taken = rows[:limit - len(jobs)]
            jobs += [j for r in taken if (j := self._decode(r)) is not None]
            more = len(rows) > len(taken)
            if not more or len(jobs) == limit:
                # the cursor is the last row taken, read or not: a row left out is still a place in the history
                return Page(jobs, taken[-1]["id"] if more else None)
            before = taken[-1]["id"]

    def _page(self, status: str | None, model: str | None, before: str | None, limit: int) -> list[sqlite3.Row]:
        return self._db().execute(
            "SELECT * FROM jobs WHERE (:status IS NULL OR status = :status) AND (:model IS NULL OR model = :model) "
            "AND (:before IS NULL OR seq < (SELECT seq FROM jobs WHERE id = :before)) ORDER BY seq DESC LIMIT :limit",
            {"status": status, "model": model, "before": before, "limit": limit}).fetchall()

    async def delete(self, job: Job) -> None:
        files = [i.file for i in job.items if i.file]
        files += [f["file"] for i in job.items for f in (i.trajectory_files or {}).values()]
        try:
            await self._run(self._delete_checked, job.id, files)
        except (OSError, sqlite3.Error) as exc:
            if not disk_full(exc):
                raise self._failure(exc, f"delete job {job.id}") from None
            # The row's DELETE needs room in the WAL: the job's files go first (nobody starts reading them, the job
            # is in ``files.deleting``), so that deleting finished jobs can empty a full disk.
            log.warning("the disk holding %s is full: job %s's files are deleted before its record", self.dir, job.id)
            try:
                await self._run(self._unlink, files)
                await self._run(self._delete_checked, job.id, files)
            except (OSError, sqlite3.Error) as again:
                raise self._failure(again, f"delete job {job.id} (its files are deleted, its record is "
                                           "not: DELETE it again once there is room)") from None

    def _delete_checked(self, job_id: str, files: list[str]) -> None:
        self.faults.check_space()  # --test-state-fault enospc_file: a full disk for the tests
        self._delete(job_id, files)

    def _unlink(self, files: list[str]) -> None:
        for name in files:
            (self.outputs_dir / name).unlink(missing_ok=True)

    def _delete(self, job_id: str, files: list[str]) -> None:
        self._db().execute("DELETE FROM jobs WHERE id = ?", (job_id,))  # first: nobody finds the files after
        # every file named for the job, listed or not: a job read back from its row knows only a succeeded run's
        # files, and a first run's output can outlive a second that failed
        for path in {*(self.outputs_dir / name for name in files), *self.outputs_dir.glob(f"{job_id}-*")}:
            path.unlink(missing_ok=True)

    async def expired(self, keep_days: float, keep_bytes: int) -> list[Job]:
        rows = await self._run(self._expired, keep_days, keep_bytes)
        return [j for r in rows if (j := self._decode(r)) is not None]

    def _expired(self, keep_days: float, keep_bytes: int) -> list[sqlite3.Row]:
        rows = self._db().execute(f"SELECT * FROM jobs WHERE status NOT IN {LIVE} ORDER BY seq").fetchall()
        cutoff = time.time() - keep_days * 86400 if keep_days else None
        total = sum(r["bytes"] for r in rows)
        out = []
        for r in rows:
            # age from the job's end, not its creation: a job that waited long in the queue, or a clock set back
            # since it was created, must not be deleted the moment it finishes
            ended = r["ended"] if r["ended"] is not None else r["created"]
            if (cutoff is not None and ended < cutoff) or (keep_bytes and total > keep_bytes):
                out.append(r)
                total -= r["bytes"]
        return out

    # output files (encode pool threads) -------------------------------------------------------
    def write_output(self, job_id: str, index: int, ext: str, parts: Sequence[bytes | memoryview]) -> tuple[str, int]:
        name = f"{job_id}-{index}.{ext}"
        try:
            return name, output_files.write(self.outputs_dir, name, parts, self.faults)
        except OSError as exc:
            raise self._failure(exc, f"write output {index} of job {job_id}") from None

    def read_output(self, name: str) -> bytes:
        return (self.outputs_dir / name).read_bytes()

    def discard_outputs(self, names: Sequence[str]) -> None:
        for name in names:
            try:
                (self.outputs_dir / name).unlink(missing_ok=True)
            except OSError as exc:  # the next start's sweep takes it
                log.warning("could not remove %s, which no job lists: %s", self.outputs_dir / name, exc)

    async def sweep_outputs(self) -> int:
        return await self._run(self._sweep_outputs)

    def _sweep_outputs(self) -> int:
        rows = self._db().execute(f"SELECT id, outputs FROM jobs WHERE status NOT IN {LIVE}").fetchall()
        return output_files.sweep(self.outputs_dir, rows)

    async def close(self) -> None:
        """Write what is pending, then close the database. From its start on every call is the shutdown's 503
        (``_submit``) and a late ``update`` is dropped with a warning; what was queued before it still lands, in
        order. A second close does nothing."""
        if self._closing:
            return
        self._closing = True
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)
        if self._con is not None:  # behind every call queued before the close: the thread takes them in order
            await asyncio.get_running_loop().run_in_executor(self._thread, self._close_db)
        self._thread.shutdown(wait=True)
        self._lock.release()

    def _close_db(self) -> None:
        try:
            self._last_try()
        finally:
            con, self._con = self._db(), None
            con.close()

    def _last_try(self) -> None:
        """The endings not yet written, once more; those still not on disk are named: the next start
        runs them again, though their clients were told they had ended."""
        if self._unwritten:
            self._write_unwritten()
        if not (ids := list(self._unwritten)):
            return
        with contextlib.suppress(sqlite3.Error):  # only those whose record is still live will run again
            marks = ", ".join("?" * len(ids))
            live = self._db().execute(f"SELECT id FROM jobs WHERE id IN ({marks}) AND status IN {LIVE}", ids)
            ids = [r[0] for r in live]
        if ids:
            log.error("could not record in %s that job(s) %s ended: the next start runs them again, though their "
                      "clients were told they had ended; free space on the disk holding %s before restarting",
                      self.db_path, ", ".join(ids), self.dir)
