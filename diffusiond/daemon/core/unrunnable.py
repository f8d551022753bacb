"""Queued jobs residency says will never run: their model failed to load, no longer fits, or (issue 27) their
own size no longer fits, which only a measurement made after they were admitted can show.

Split off the engine, which keeps the one ending (``Engine._end``): this module only picks who ends. A size
that no longer fits ends the jobs of that size alone (one output each, as admission sized them); the
model's other jobs may still fit, and are asked about in turn.
"""

from __future__ import annotations

import logging
from typing import Protocol

from diffusiond.daemon.core.jobs import Job
from diffusiond.daemon.core.scheduler import Scheduler
from diffusiond.daemon.residency import ondemand
from diffusiond.daemon.residency.keeper import Keeper, shape_of
from diffusiond.daemon.residency.working import Shape
from diffusiond.daemon.workers.pool import Model
from diffusiond.protocol import ErrorCode, JobStatus, WorkerState

log = logging.getLogger(__name__)


class Engine(Protocol):
    """What of the engine (``engine.Engine``) this module uses, named here so that it does not import it."""

    scheduler: Scheduler
    keeper: Keeper

    def _end(self, job: Job, status: JobStatus, code: ErrorCode | None = None, message: str = "",
             stage: str | None = None) -> None: ...


def fail_queued(engine: Engine, model: str, message: str, code: ErrorCode, shape: Shape | None) -> None:
    """The jobs waiting for ``model`` (of ``shape`` only, where given) fail with ``message``: the keeper's ``fail``."""
    for job in engine.scheduler.waiting(model):
        if shape is None or shape_of(*job.request.work_size, 1, job.request.num_frames) == shape:
            engine._end(job, JobStatus.FAILED, code, message, stage=job.stage_label)


def unreplaced(engine: Engine, model: Model, why: str, gave_up: bool) -> None:
    """A lost worker's replacement did not start (the pool's ``on_unreplaced``). Its model's queued jobs fail with
    why, unless another of its workers (another device) runs them: they waited for it, then passed their deadline
    saying only that. Once the pool gives up on a model with no worker left, the model is on disk with the reason,
    as after a failed load: its next job loads it. One still serving on another device is not marked failed: that
    would fail its jobs and keep the live worker from being sent any."""
    if any(w.state in (WorkerState.READY, WorkerState.SLEEPING) for w in model.workers):
        log.warning("%s serves on with its workers on its other devices: %s", model.name, why)
    elif gave_up:
        ondemand.load_failed(engine.keeper, model, why)
    else:
        fail_queued(engine, model.name, f"model {model.name!r} cannot run jobs now: {why}. The daemon tries again "
                    "after a back-off: submit the job again once `diffusiond models` shows it ready",
                    ErrorCode.MODEL_LOAD_FAILED, None)
