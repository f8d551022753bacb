"""The store on its own: what a state dir SQLite cannot use says at start, what a failed delete says, and a
row that does not decode. Real SQLite files and real errors where they can be made
here; a full disk's codes, which need a full disk, are given to the classification directly."""

from __future__ import annotations

import logging
import os
import sqlite3
from pathlib import Path

import pytest

from diffusiond.daemon.core.jobs import Item, Job, JobRequest
from diffusiond.daemon.errors import InsufficientStorage
from diffusiond.daemon.state.statedir import ForeignDatabase, StateDirError, start_problem
from diffusiond.daemon.state.store import SqliteStore
from diffusiond.protocol import JobStatus, Stage

REQ = JobRequest(model="tiny", prompt="a fox", n=1, width=64, height=64, steps=2, guidance=1.0,
                 output_format="png", seed=5)


def job() -> Job:
    j = Job(REQ)
    j.items = [Item(j, 0, seed=100)]
    return j


def coded(code: int, message: str) -> sqlite3.OperationalError:
    exc = sqlite3.OperationalError(message)
    exc.sqlite_errorcode = code  # type: ignore[attr-defined]
    return exc


async def finished(store: SqliteStore) -> Job:
    j = job()
    await store.add(j)
    j.items[0].file, j.items[0].nbytes = store.write_output(j.id, 0, "png", [b"\x89PNG" * 100])
    j.items[0].stage = Stage.DONE
    j.end(JobStatus.SUCCEEDED)
    store.update(j)
    return j


# start: which errors mean "not ours" ---------------------------------------------------------
def test_only_a_file_that_is_not_a_database_is_not_ours(tmp_path: Path) -> None:
    db = tmp_path / "jobs.db"
    db.write_bytes(os.urandom(16384))
    with pytest.raises(sqlite3.DatabaseError) as notadb:
        sqlite3.connect(db).execute("PRAGMA application_id").fetchone()
    assert start_problem(db, notadb.value) is None
    assert start_problem(db, coded(sqlite3.SQLITE_CORRUPT, "database disk image is malformed")) is None
    assert start_problem(db, ForeignDatabase("it holds tables photos and no diffusiond mark")) is None

    for code in (sqlite3.SQLITE_FULL, sqlite3.SQLITE_IOERR | (3 << 8)):  # SQLITE_IOERR_WRITE on a full tmpfs
        problem = start_problem(db, coded(code, "disk I/O error"))
        assert problem is not None
        assert "not a diffusiond" not in str(problem) and str(tmp_path) in str(problem)
    assert "is full" in str(start_problem(db, coded(sqlite3.SQLITE_FULL, "database or disk is full")))
    assert "another process holds" in str(start_problem(db, coded(sqlite3.SQLITE_LOCKED, "database table is locked")))


def test_a_jobs_db_that_is_a_folder_is_named_and_never_moved_aside(tmp_path: Path) -> None:
    (tmp_path / "jobs.db").mkdir()
    with pytest.raises(sqlite3.OperationalError) as cantopen:
        sqlite3.connect(tmp_path / "jobs.db")
    problem = start_problem(tmp_path / "jobs.db", cantopen.value)
    assert problem is not None and "is not a file" in str(problem), problem


async def test_a_database_another_process_holds_locked_is_refused_and_kept_even_with_reset(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path)
    await store.open()
    j = await finished(store)
    await store.close()
    holder = sqlite3.connect(tmp_path / "jobs.db", isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(StateDirError, match=r"another process holds .*jobs\.db open"):
            await SqliteStore(tmp_path, reset=True).open()  # SQLite's own 5 s wait first
    finally:
        holder.close()
    assert not [p for p in tmp_path.iterdir() if ".bad-" in p.name]
    store = SqliteStore(tmp_path)
    await store.open()
    assert (await store.load(j.id)) is not None
    await store.close()


async def test_a_lock_file_that_cannot_be_opened_is_a_refusal_naming_it(tmp_path: Path) -> None:
    (tmp_path / "lock").mkdir()
    with pytest.raises(StateDirError, match=f"cannot open {tmp_path}/lock: Is a directory"):
        await SqliteStore(tmp_path).open()


# delete on a full disk -------------------------------------------------------------------------
async def test_delete_on_a_full_disk_removes_the_files_first_and_is_a_507_naming_the_state_dir(
        tmp_path: Path) -> None:
    flag = tmp_path / "full"
    store = SqliteStore(tmp_path / "state", faults=f"enospc_file={flag}")
    await store.open()
    j = await finished(store)
    output = store.outputs_dir / j.items[0].file
    flag.touch()
    with pytest.raises(InsufficientStorage) as full:
        await store.delete(j)
    assert str(store.dir) in str(full.value) and "DELETE it again" in str(full.value)
    assert not output.exists(), "the files go first: they make the room the record's delete needs"
    assert (await store.load(j.id)) is not None
    flag.unlink()
    await store.delete(j)
    assert (await store.load(j.id)) is None
    await store.close()


# rows that do not decode ----------------------------------------------------------------------
async def test_a_row_that_does_not_decode_is_left_out_with_a_warning_and_an_unfinished_one_ends_failed(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = SqliteStore(tmp_path)
    await store.open()
    old, bad, new = [await finished(store) for _ in range(3)]
    queued_bad, queued_ok = job(), job()
    await store.add(queued_bad)
    await store.add(queued_ok)
    await store.close()
    con = sqlite3.connect(tmp_path / "jobs.db")
    with con:
        con.execute("UPDATE jobs SET request = substr(request, 1, 40) WHERE id IN (?, ?)", (bad.id, queued_bad.id))
    con.close()

    caplog.set_level(logging.WARNING)
    store = SqliteStore(tmp_path)
    left = await store.open()
    assert [j.id for j in left] == [queued_ok.id], "one bad row does not stop the start"
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert queued_bad.id in warned and str(tmp_path / "jobs.db") in warned

    assert await store.load(bad.id) is None
    assert (await store.load(old.id)) is not None
    page = await store.page(None, None, None, 100)
    assert [j.id for j in page.jobs] == [queued_ok.id, new.id, old.id] and page.next_before is None
    ids, before = [], None  # one at a time: the bad row is a place in the history, never a dead end
    while True:
        page = await store.page(JobStatus.SUCCEEDED.value, None, before, 1)
        ids += [j.id for j in page.jobs]
        if page.next_before is None:
            break
        before = page.next_before
    assert ids == [new.id, old.id]
    assert bad.id in " ".join(r.getMessage() for r in caplog.records)
    await store.close()

    con = sqlite3.connect(tmp_path / "jobs.db")
    status, error = con.execute("SELECT status, error FROM jobs WHERE id = ?", (queued_bad.id,)).fetchone()
    con.close()
    assert status == "failed" and "state_failed" in error and "does not read" in error
    store = SqliteStore(tmp_path)
    assert [j.id for j in await store.open()] == [queued_ok.id]  # not warned of and tried again at every start
    await store.close()
