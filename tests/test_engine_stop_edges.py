"""A stop while an output's file is still being written (SIGTERM under load), against the engine with fake workers.

The stop shut the encode pool while an output's write was still in it: the write's own clean-up (the file of a job
that had ended meanwhile goes, its record lists none of it) then found the pool shut, and its task died with
``cannot schedule new futures after shutdown``, logged at the stop, with the file left behind until the next start.
And a cancel of a job the stop keeps for the next start answered 200 while cancelling nothing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import sqlite3
from pathlib import Path

import pytest
from enginekit import Harness, gate_writes, until

from diffusiond.daemon.core.jobs import JobRequest
from diffusiond.daemon.errors import NotAccepting
from diffusiond.daemon.state.store import SqliteStore
from diffusiond.protocol import ErrorCode, JobStatus

REQ = JobRequest(model="m", prompt="x", n=1, width=64, height=64, steps=2, guidance=1.0, output_format="png", seed=1)


@pytest.mark.parametrize("sync", [True, False])
async def test_a_stop_while_an_output_is_written_ends_cleanly_and_keeps_the_jobs_record(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, sync: bool) -> None:
    """A synchronous job the drain fails while its output is written: its failure is recorded and the file that
    no record lists is gone. A job of /v1/jobs, left to the next start, is done once its output lands during the
    stop: its record says so and lists the file (it stayed unfinished, and the next start ran it again from
    scratch). Either way the stop logs no error."""
    h = Harness(store=SqliteStore(tmp_path), max_batch=1)
    await h.engine.start()
    gate, writing = gate_writes(h, 10)
    close, outputs = h.engine.outputs.close, h.engine.outputs

    def close_then_let_the_write_end() -> None:  # the stop is under way: its workers are stopped
        close()
        gate.set()

    outputs.close = close_then_let_the_write_end  # type: ignore[method-assign]
    pool = h.engine.executor
    shutdown, under_way = pool.shutdown, []

    def shutdown_seeing_what_is_under_way(wait: bool = True, *, cancel_futures: bool = False) -> None:
        under_way.append(len(outputs._tasks))  # the outputs' work the shut pool would refuse the rest of
        shutdown(wait=wait, cancel_futures=cancel_futures)

    pool.shutdown = shutdown_seeing_what_is_under_way  # type: ignore[method-assign]
    try:
        job = await h.engine.accept(dataclasses.replace(REQ), sync=sync)
        await until(lambda: bool(h.worker.executed))
        h.worker.finish(h.worker.executed[0])
        await until(writing.is_set)
        await h.engine.drain(0)  # SIGTERM: the grace is over with the output still being written
        caplog.set_level(logging.WARNING)
        await h.engine.stop()
    finally:
        gate.set()
    assert under_way == [0], "the encode pool was shut with an output's work still under way"
    gc.collect()  # a task that died unread says so when it is collected
    await asyncio.sleep(0)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], errors
    row = sqlite3.connect(tmp_path / "jobs.db").execute("SELECT status, error FROM jobs WHERE id = ?",
                                                        (job.id,)).fetchone()
    files = sorted(p.name for p in (tmp_path / "outputs").iterdir())
    if sync:
        assert row[0] == JobStatus.FAILED.value and ErrorCode.SHUTTING_DOWN.value in row[1]
        assert files == [], "an output file no record lists was left behind"
    else:
        assert row[0] == JobStatus.SUCCEEDED.value, "the next start runs it again"
        assert len(files) == 1, files


async def test_a_cancel_of_a_job_the_stop_keeps_for_the_next_start_is_refused_saying_so(tmp_path: Path) -> None:
    """Past the drain's grace, a job of /v1/jobs stays in the state dir for the next start. A cancel then (the HTTP
    server answers until the engine has stopped; a Ctrl-C on ``diffusiond generate``) answered 200 with the job
    still queued, and the next start ran it: the client was told nothing true. It is refused, saying why."""
    h = Harness(store=SqliteStore(tmp_path), max_batch=1)
    await h.engine.start()
    job = await h.engine.accept(dataclasses.replace(REQ))
    await until(lambda: bool(h.worker.executed))
    await h.engine.drain(0)
    with pytest.raises(NotAccepting) as refused:
        h.engine.cancel(job.id)
    assert refused.value.code == ErrorCode.SHUTTING_DOWN and job.id in refused.value.message
    assert "runs again" in refused.value.message and not job.terminal
    await h.engine.stop()
    again = Harness(store=SqliteStore(tmp_path), max_batch=1)
    await again.engine.start()
    try:
        assert not again.engine.jobs[job.id].terminal, "the next start runs it, as the refusal said"
    finally:
        await again.close()


async def test_a_history_read_after_the_store_closed_is_refused_as_the_shutdown_not_failed(tmp_path: Path) -> None:
    """The HTTP server answers until the engine has stopped; a history read or delete that reached the closed store
    answered 500 internal_error (its thread shut, or its connection gone)."""
    store = SqliteStore(tmp_path / "state")
    await store.open()
    await store.close()
    for read in (store.load("job_x"), store.page(None, None, None, 10)):
        with pytest.raises(NotAccepting) as caught:
            await read
        assert caught.value.code == ErrorCode.SHUTTING_DOWN
        assert "ask again" in str(caught.value)


async def test_a_stop_whose_workers_stop_fails_still_closes_the_state_dir(tmp_path: Path) -> None:
    """The workers' stop raised (the template's reaper did, on a signal with no name): the engine's stop ended
    there, its outputs unsettled, its encode pool running and its state dir still locked and unwritten."""
    h = Harness(store=SqliteStore(tmp_path), max_batch=1)
    await h.engine.start()
    stop = h.engine.pool.stop

    async def failing_stop() -> None:
        await stop()
        raise ValueError("35 is not a valid Signals")

    h.engine.pool.stop = failing_stop  # type: ignore[method-assign]
    with pytest.raises(ValueError, match="35"):
        await h.engine.stop()
    again = Harness(store=SqliteStore(tmp_path), max_batch=1)
    await again.engine.start()  # the state dir was let go: the next start takes it
    await again.close()
