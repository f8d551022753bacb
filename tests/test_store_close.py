"""The store's close, as the engine's stop meets it: what was queued before it still lands, in order; every
call after it is the shutdown's 503 (the HTTP server answers until the engine has stopped), never a 500; and a
second close does nothing.

The in-memory store keeps nothing: its reads say "nothing kept" before and after close alike, so the edge answers
from the engine's memory (a job not there is a 404, which stays true after a restart, unlike a 503's "ask again")."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from diffusiond.daemon.core.jobs import Item, Job, JobRequest
from diffusiond.daemon.errors import NotAccepting
from diffusiond.daemon.state.store import SqliteStore, Store
from diffusiond.ipc.messages import Capabilities
from diffusiond.protocol import ErrorCode, JobStatus

REQ = JobRequest(model="tiny", prompt="a fox", n=1, width=64, height=64, steps=2, guidance=1.0,
                 output_format="png", seed=5)


def job() -> Job:
    j = Job(REQ)
    j.items = [Item(j, 0, seed=100)]
    return j


async def test_a_second_close_does_nothing(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path)
    await store.open()
    await store.close()
    await store.close()  # the first took the connection: nothing is left to write, close or refuse


async def test_what_was_queued_before_close_still_lands_in_order(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path, faults="update_delay_ms=200")
    await store.open()
    j = job()
    await store.add(j)
    j.status = JobStatus.RUNNING
    written = store.update(j)  # slow: close begins while it is still in the store's thread
    read = asyncio.ensure_future(store.load(j.id))  # queued behind the write
    await asyncio.sleep(0)
    await store.close()
    assert written is not None and written.done() and written.exception() is None
    back = await read
    assert back is not None and back.status == JobStatus.RUNNING, "the read ran after the write, before the close"

    again = SqliteStore(tmp_path)
    try:
        assert [x.id for x in await again.open()] == [j.id]
    finally:
        await again.close()


async def test_every_call_after_close_is_the_shutdown(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = SqliteStore(tmp_path)
    await store.open()
    kept = job()
    await store.add(kept)
    await store.close()
    calls = {"load": store.load(kept.id), "page": store.page(None, None, None, 10),
             "expired": store.expired(0, 1), "capabilities": store.capabilities(),
             "working_memory": store.working_memory(), "add": store.add(job()), "delete": store.delete(kept),
             "sweep_outputs": store.sweep_outputs()}
    for name, call in calls.items():
        with pytest.raises(NotAccepting) as caught:
            await call
        assert caught.value.code == ErrorCode.SHUTTING_DOWN, name
        assert "shutting down" in str(caught.value) and "ask again" in str(caught.value), name
    with caplog.at_level(logging.WARNING, "diffusiond.daemon.state"):
        kept.status = JobStatus.RUNNING
        assert store.update(kept) is None
        store.remember("tiny", Capabilities())
        store.remember_working("tiny", {})
    assert sum("not recorded" in r.getMessage() for r in caplog.records) == 3


async def test_the_in_memory_store_reads_nothing_kept_after_close_too() -> None:
    store = Store()
    assert await store.open() == []
    await store.close()
    await store.close()
    assert await store.load("j_00") is None
    page = await store.page(None, None, None, 10)
    assert (page.jobs, page.next_before) == ([], None)
    assert store.update(job()) is None
