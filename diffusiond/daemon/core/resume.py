"""The jobs one run of the daemon leaves to the next: taken back at start, left on purpose at a clean stop.

Apart from ``engine.py`` because it is the engine's one conversation with the past and the future
(the state dir), not with clients or workers; the functions take the engine (``self``) and use
its own transitions (``_end``, ``_arm_deadline``), so a resumed job ends the way every job does.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from typing import Protocol

from diffusiond.daemon.core.jobs import Item, Job
from diffusiond.daemon.core.scheduler import Scheduler
from diffusiond.daemon.residency.keeper import Keeper
from diffusiond.daemon.state.history import History
from diffusiond.daemon.state.store import Store
from diffusiond.daemon.workers.pool import Model, WorkerPool
from diffusiond.protocol import ErrorCode, Event, JobStatus


class Engine(Protocol):
    """What of the engine (``engine.Engine``) these functions use, named here so that this module
    does not import the one that imports it."""

    store: Store
    pool: WorkerPool
    scheduler: Scheduler
    keeper: Keeper
    history: History
    jobs: dict[str, Job]
    items: dict[str, Item]
    accepting: bool
    draining: bool
    _suspended: set[str]

    def _end(self, job: Job, status: JobStatus, code: ErrorCode | None = None, message: str = "",
             stage: str | None = None) -> None: ...
    def _arm_deadline(self, job: Job) -> None: ...
    async def _wait_until(self, done: Callable[[], bool], timeout: float) -> None: ...

log = logging.getLogger(__name__)


async def recover(self: Engine) -> None:
    """Queue again, in their admission order, the jobs the last run accepted and did not
    finish. One that had started runs again from the start (its seeds are fixed, so its
    outputs are the ones it would have made) and counts the attempt. A synchronous one (a crash
    left it: a stop does not keep them) ends, saying why: its caller is gone."""
    jobs = await self.store.open()
    # before any job runs again (each rewrites its files from the start): files no finished job lists go
    await self.store.sweep_outputs()
    remembered = await self.store.capabilities()
    for model in self.pool.models.values():
        caps = remembered.get(model_key(model))
        if caps is not None and not model.known:
            model.capabilities, model.known = caps, True
    # and what their runs were measured to need (filed like the capabilities: another spec, another model)
    working = await self.store.working_memory()
    self.keeper.policy.measurements.remember({m.name: working[model_key(m)] for m in self.pool.models.values()
                                              if model_key(m) in working})
    for job in jobs:
        if job.status == JobStatus.RUNNING:
            job.attempts += 1
        job.status = JobStatus.QUEUED
        self.jobs[job.id] = job
        for item in job.items:
            self.items[item.request_id] = item
        if job.id in self.store.lost_inputs:
            self._end(job, JobStatus.FAILED, ErrorCode.INPUT_LOST,
                      "the daemon stopped before this edit finished, and an edit's input image is not kept in "
                      "the state dir: submit it again")
            continue
        if job.sync:  # its caller's connection ended with the last run: nobody would read it
            self._end(job, JobStatus.FAILED, ErrorCode.SHUTTING_DOWN,
                      "the daemon stopped before this synchronous request finished, and the request's connection "
                      "ended with it: send the request again")
            continue
        if job.request.model not in self.pool.models:
            self._end(job, JobStatus.FAILED, ErrorCode.MODEL_NOT_FOUND,
                      f"model {job.request.model!r} is no longer served here (the daemon restarted with "
                      f"models {', '.join(self.pool.models)})")
            continue
        self.scheduler.admit(job)  # over the queue limit if need be: these were accepted already
        self._arm_deadline(job)
        self.store.update(job)
    if jobs:
        log.info("resuming %d job(s) the last run did not finish", len(jobs))
    self.history.recovered.set()  # a request for one of them waited for this (History.find)

async def drain(self: Engine, grace: float, why: str | None = None, unloaded: Collection[str] = ()) -> None:
    """Stop admitting; give accepted jobs ``grace`` seconds to finish; then what is left either
    waits in the state dir for the next start (``_suspend``) or fails with the reason (``why``, where
    the daemon stops because its start failed, else the grace period's end). Jobs queued for ``unloaded``
    (models a stop kept the start's preload from loading) are left so at once: nothing would run them."""
    self.accepting = False
    self.draining = True
    _leave(self, [j for j in self.jobs.values() if not j.terminal and j.status == JobStatus.QUEUED
                  and j.request.model in unloaded], grace, why)
    await self._wait_until(lambda: not any(_waited(self, j) for j in self.jobs.values()), grace)
    _leave(self, [j for j in self.jobs.values() if _waited(self, j)], grace, why)


def _waited(self: Engine, job: Job) -> bool:
    """A job the drain gives its grace: one left to the next start already stays queued, yet nothing here runs it."""
    return not job.terminal and job.id not in self._suspended


def _leave(self: Engine, jobs: list[Job], grace: float, why: str | None) -> None:
    for job in jobs:
        if self.store.persistent and not job.sync and job.request.buffer is None:  # no edit, control or reference
            suspend(self, job)
            continue
        self._end(job, JobStatus.FAILED, ErrorCode.SHUTTING_DOWN,
                  f"{why} (stage {job.stage.label})" if why else
                  f"the daemon shut down before the job finished (grace period {grace:g}s, stage "
                  f"{job.stage.label})")

def suspend(self: Engine, job: Job) -> None:
    """Leave a job to the next start, as a crash would, but on purpose: a restart or a reboot
    must not cost a user the jobs they queued. Its record stays queued or running (running
    ones run again from the start, their seeds fixed), and this process ends it no more: not by
    its deadline, nor by the workers stopping under it. Synchronous jobs are not kept (their
    caller is answered now and would not come back for the result), nor edits (their input
    image is not in the state dir)."""
    self._suspended.add(job.id)
    if job.deadline is not None:
        job.deadline.cancel()
        job.deadline = None
    self.scheduler.remove(job)
    job.emit(Event.STATUS)
    log.info("job %s (%s) stays in the state dir: it resumes when the daemon starts again",
             job.id, job.stage.label)


def model_key(model: Model) -> str:
    """What a model's remembered capabilities are filed under: the same name serving another
    spec after a restart must not inherit them."""
    return f"{model.name}={model.config.spec}"
