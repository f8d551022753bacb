"""What a job's ending sets going beside its status: the record of it, the announcement once that is on
disk, and the work still out on workers that nobody wants now.

Apart from ``engine.py``, which keeps the one ending (``Engine._end``) and calls these in order.

Why the announcement waits for the record: a client told "done" or "cancelled" (an SSE
``done``/``error``, a synchronous answer, a DELETE's 200) must never meet the job running again after a
crash, and a job whose row still says queued or running is resumed at the next start. The status in memory
changes at once (a GET may show it a moment before the commit); only the telling waits.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Callable
from typing import Any

from diffusiond.daemon.core.flights import Flights
from diffusiond.daemon.core.jobs import Job
from diffusiond.daemon.errors import EngineError
from diffusiond.daemon.outputs.slots import Outputs
from diffusiond.daemon.state.store import Store
from diffusiond.daemon.workers.link import WorkerLink
from diffusiond.protocol import ErrorCode, JobStatus


def admitted(store: Store, job: Job, end: Callable[..., Any]) -> asyncio.Future[None]:
    """A new job's record, started now; the caller shields it, so it lands also when its client has gone. One the
    store refuses (a full disk: 507, a broken database) ends the job with the store's reason, whether or not
    anyone still waits; a waiting caller gets the error too."""
    adding = asyncio.ensure_future(store.add(job))

    def refused(f: asyncio.Future[None]) -> None:
        err = None if f.cancelled() else f.exception()
        if err is not None and not job.terminal:
            code = err.code if isinstance(err, EngineError) else ErrorCode.STATE_FAILED
            end(job, JobStatus.FAILED, code, str(err))

    adding.add_done_callback(refused)
    return adding


def record(store: Store, job: Job) -> None:
    """Write the ending; listeners and waiters hear of it when the write is done. A write that fails
    is the store's to try again (``SqliteStore._unwritten``); they hear of it then too, since waiting
    for a disk that may never have room would leave them hanging."""
    job.recorded = store.update(job)
    if job.recorded is None:  # nothing is written (--no-persist, a closed store): nothing to wait for
        job.announce()
    else:
        job.recorded.add_done_callback(lambda _: job.announce())


async def recorded(job: Job) -> None:
    """Wait until a job's ending is on disk; the store's domain error (507 for a full disk) where it is not.
    Shielded: a client that leaves does not cancel the write."""
    if job.recorded is not None:
        await asyncio.shield(job.recorded)


def stop_work(job: Job, outputs: Outputs, flights: Flights) -> None:
    """A job that did not succeed: give back what its outputs hold and cancel what workers still run of it."""
    cancels: dict[WorkerLink, list[str]] = collections.defaultdict(list)
    for item in job.items:
        if item.worker is not None and not item.delivered:
            cancels[item.worker].append(item.request_id)
    outputs.discard(job)
    for worker, ids in cancels.items():
        with contextlib.suppress(Exception):
            worker.cancel(ids)
    flights.jobs_ended(cancels)


def deadline_passed(job: Job, timeout: float, asleep: int | None) -> str:
    """Why a job ended at its deadline: the stage it was held in (residency's reason where that held it), the
    workers it was on, or the sleep (``asleep``: its level) that it waited out, with how to end that."""
    where = f" on {', '.join(job.workers())}" if job.workers() else ""
    if asleep is not None and not job.workers():  # it waited for a wake that did not come
        where += (f" (the daemon is asleep, sleep level {asleep}: nothing runs until it wakes; "
                  "wake it with `diffusiond wake` or POST /v1/admin/wake)")
    return f"job {job.id} passed its deadline of {timeout:g}s while {job.stage_label}{where}"
