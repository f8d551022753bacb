"""Batches in flight: from the queue to a worker, through compute and copy, until the last output lands.

The engine (``engine.py``) owns jobs and their endings; this module owns the other half of the
loop's state, the batches a worker holds. It takes batches from the scheduler for each ready
worker (at most ``MAX_BATCHES_PER_WORKER``: one computing, one waiting, so the GPU never waits for
the engine), sends them, and turns the worker's per-batch frames (progress, compiling, compute
done, outputs) into stages on the batch's items. It never ends a job: what a worker says about a
job's fate goes back to the engine, which has the one ending (``Engine._end``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from diffusiond.daemon.core.jobs import Item, Job, JobRequest
from diffusiond.daemon.core.resume import model_key
from diffusiond.daemon.core.scheduler import Scheduler, Wait
from diffusiond.daemon.metrics import Metrics
from diffusiond.daemon.outputs.slots import Outputs
from diffusiond.daemon.residency.decisions import LOADING
from diffusiond.daemon.residency.keeper import Keeper, shape_of
from diffusiond.daemon.residency.working import Shape
from diffusiond.daemon.state.store import Store
from diffusiond.daemon.workers.link import WorkerLink
from diffusiond.daemon.workers.pool import Model, WorkerPool
from diffusiond.ipc.errors import ArenaError, FrameTooLarge
from diffusiond.ipc.messages import ComputeDone, Execute, OutputReady, Progress, RequestSpec
from diffusiond.protocol import Event, JobStatus, Stage, WorkerState

log = logging.getLogger(__name__)

MAX_BATCHES_PER_WORKER = 2  # one computing, one waiting: the GPU never waits for the engine


@dataclass(eq=False)
class Batch:
    id: int
    worker: WorkerLink
    items: list[Item]
    open_items: int
    computing: bool = False
    compute_done: bool = False
    done_at: float = 0.0
    compiling_since: float = 0.0  # when the worker said it compiles this batch's shape


class Flights:
    def __init__(self, pool: WorkerPool, scheduler: Scheduler, outputs: Outputs, store: Store, metrics: Metrics,
                 *, held: Callable[[], bool], changed: asyncio.Event, keeper: Keeper,
                 unsendable: Callable[[Item, str], None] = lambda item, why: None) -> None:
        self.pool, self.scheduler, self.outputs, self.store, self.metrics = pool, scheduler, outputs, store, metrics
        self.held = held  # sleeping or stopping: nothing is dispatched
        self.changed = changed
        self.keeper = keeper  # residency: whether a model may take work now, and what its batches hold
        self.unsendable = unsendable  # the engine fails an item whose batch cannot be sent for its own fault
        pool.on_departed = self.departed
        self.batches: dict[int, Batch] = {}
        self.in_flight: dict[WorkerLink, collections.deque[Batch]] = {}
        self._batch_ids = 0
        self._timer: asyncio.TimerHandle | None = None
        self._orphans_killed: dict[WorkerLink, int] = {}  # killed for this batch, which no job wanted (``jobs_ended``)
        self._orphan_timers: set[int] = set()  # batches a kill timer watches

    def dispatch(self) -> None:
        if self.held():
            return
        now = time.monotonic()
        wake_at: float | None = None
        self.keeper.review()  # whose turn it is on each device, before any model is asked
        failed: set[WorkerLink] = set()  # a worker a batch could not be sent to takes none again this pass
        # the model whose job has waited longest is asked first: when a move has just made room on a
        # device, the model it was made for takes it, not one whose job came while the move ran
        for model in sorted(self.pool.models.values(), key=self._waited_since):
            waiting = self.scheduler.waiting(model.name)
            if not waiting:
                continue
            ready = [w for w in model.workers if w.state == WorkerState.READY and w not in self.pool.preparing]
            if ready and all(len(self.in_flight.get(w, ())) >= MAX_BATCHES_PER_WORKER for w in ready):
                continue  # nothing could be sent now: asking residency could send an idle model away for nothing
            head = waiting[0].request  # and the batch the scheduler would send now: residency makes its room
            go = self.keeper.may_dispatch(model, shape_of(*head.work_size, self.scheduler.forming(model.name),
                                                          head.num_frames))
            if go is None:
                why = self.keeper.why_waiting(model.name)
                self._hold(waiting, why, self.keeper.load_bytes(model) if why == LOADING else (None, None))
                continue
            self._hold(waiting, None)
            while True:
                ready = [w for w in model.workers if w.state == WorkerState.READY and w not in self.pool.preparing
                         and w not in failed
                         and len(self.in_flight.setdefault(w, collections.deque())) < MAX_BATCHES_PER_WORKER]
                if not ready:
                    break
                worker = min(ready, key=lambda w: len(self.in_flight[w]))
                # An idle worker takes whatever is there; a busy one only a full batch (see Scheduler).
                got = self.scheduler.next_batch(model.name, now, partial_ok=not self.in_flight[worker],
                                                most=go.most)
                if got is None:
                    break
                if isinstance(got, Wait):
                    wake_at = got.until if wake_at is None else min(wake_at, got.until)
                    break
                if not self._send(worker, got):
                    # picked again at once, a READY worker whose channel had closed took the
                    # requeued batch again, for ever, and the loop never yielded to reap it
                    failed.add(worker)
        if wake_at is not None:
            if self._timer is not None:
                self._timer.cancel()
            loop = asyncio.get_running_loop()
            self._timer = loop.call_at(loop.time() + max(0.0, wake_at - now), self.dispatch)

    def _waited_since(self, model: Model) -> float:
        oldest = self.scheduler.oldest(model.name)
        return math.inf if oldest is None else oldest

    @staticmethod
    def _hold(jobs: list[Job], why: str | None, loading: tuple[int | None, int | None] = (None, None)) -> None:
        """Queued jobs say why they wait (``loading``, ``waiting_for_memory``, ``waiting_for_turn``): a STATUS
        event when it changes. While ``loading``, how far the load is, of the model's weights
        (``Keeper.load_bytes``): a STATUS event each time that moves too."""
        for job in jobs:
            if job.terminal:
                continue
            moved = (job.bytes_loaded, job.load_bytes) != loading
            job.bytes_loaded, job.load_bytes = loading
            if job.held != why or moved:
                job.held = why
                job.emit(Event.STATUS)

    def _send(self, worker: WorkerLink, items: list[Item]) -> bool:
        """Send a batch; False when the worker could not take it (its items are back at the head of the queue).
        A batch that cannot be sent for its own fault ends its jobs (``unsendable``) and counts as sent."""
        self._batch_ids += 1
        batch = Batch(self._batch_ids, worker, items, open_items=len(items))
        req = items[0].job.request
        fds: list[int] = []
        try:
            msg = Execute(batch.id, req.batch_params(), self._specs(items, fds))
            worker.execute(msg, fds)
        except Exception as exc:
            for fd in fds:  # sent frames close theirs; these never left
                with contextlib.suppress(OSError):
                    os.close(fd)
            if isinstance(exc, FrameTooLarge | ArenaError):
                # the batch's own fault (an input closed, a frame past the limit), not the worker's: put back at
                # the head of the queue, it blocked its model's queue pass after pass until its deadline; its jobs
                # fail, and the worker is free for the next batch
                log.error("a batch for %s cannot be sent: %s", worker.name, exc)
                for i in items:
                    self.unsendable(i, f"its batch could not be sent to the worker: {exc}")
                return True
            log.warning("could not send batch to %s: %s", worker.name, exc)
            self.scheduler.requeue_front(items)
            return False
        self.batches[batch.id] = batch
        for i in items:
            i.worker, i.batch_id = worker, batch.id
        self.keeper.batch_started(worker.config.model_name, _shape(items), worker.config.device)
        self.metrics.batch_size.observe(len(items))
        queue = self.in_flight[worker]
        queue.append(batch)
        if len(queue) == 1:
            self._start_computing(batch)
        return True

    @staticmethod
    def _specs(items: list[Item], fds: list[int]) -> list[RequestSpec]:
        """The requests of a batch; each edit's input buffer joins ``fds`` once per job (its own
        duplicate, which the channel closes once sent), and its requests point at it."""
        index: dict[str, int] = {}
        specs = []
        for i in items:
            r = i.job.request
            ref = None
            buffer = r.buffer
            if buffer is not None:
                if i.job.id not in index:
                    index[i.job.id] = len(fds)
                    fds.append(buffer.dup())
                ref = buffer.ref(index[i.job.id])
            specs.append(RequestSpec(request_id=i.request_id, prompt=r.prompt, seed=i.seed,
                                     negative_prompt=r.negative_prompt, input=ref, audio=r.audio_rate > 0,
                                     **_preview_fields(r)))
        return specs

    def _start_computing(self, batch: Batch) -> None:
        batch.computing = True
        now = time.monotonic()
        for item in batch.items:
            if item.job.terminal:
                continue
            item.stage = Stage.COMPUTING
            job = item.job
            if job.status == JobStatus.QUEUED:
                job.status = JobStatus.RUNNING
                self.store.update(job)
                queued_ms = (now - job.t0) * 1000
                job.add_timing("queued", queued_ms)
                self.metrics.stage_seconds.labels("queued").observe(queued_ms / 1000)
                job.emit(Event.STATUS)

    def _leave_compute(self, batch: Batch) -> None:
        """The worker is done computing ``batch``: the next one it holds is now computing."""
        queue = self.in_flight.get(batch.worker)
        if queue and batch in queue:
            queue.remove(batch)
            if queue and not queue[0].computing:
                self._start_computing(queue[0])
        self.changed.set()
        self.dispatch()

    # what the worker says of a batch ---------------------------------------------------------
    def worker_ready(self, worker: WorkerLink) -> None:
        self.in_flight[worker] = collections.deque()

    def on_progress(self, msg: Progress) -> None:
        batch = self.batches.get(msg.batch_id)
        items = batch.items if batch else []
        if msg.oom_retry and batch is not None:  # the worker runs it again: idle models on its device leave
            self.keeper.on_oom(batch.worker.config.model_name, _shape(batch.items), batch.worker.config.device)
        # COMPILING is entered from COMPUTING when the worker says the shape is new, and left
        # at the first step: a stage change is a STATUS event, so clients see it as it happens.
        stage, old = (Stage.COMPILING, Stage.COMPUTING) if msg.compiling else (Stage.COMPUTING, Stage.COMPILING)
        moved = [i for i in items if not i.job.terminal and i.stage == old]
        for item in moved:
            item.stage = stage
        if batch is not None and msg.compiling:
            batch.compiling_since = time.monotonic()
        for job in _jobs_of(moved):
            if batch is not None and not msg.compiling:  # part of compute, as the job's timings show
                job.add_timing("compiling", (time.monotonic() - batch.compiling_since) * 1000)
            job.emit(Event.STATUS)
        for job in _jobs_of(items):
            # a compiling or retry mark says "step 0" before the pipeline has counted its steps (an edit's
            # rounding, a hires pass): the job's own total holds until its steps report theirs
            total = job.request.total_steps if msg.compiling or msg.oom_retry else msg.total
            job.progress = (msg.step, total)
            job.emit(Event.PROGRESS)

    def on_compute_done(self, msg: ComputeDone) -> None:
        batch = self.batches.get(msg.batch_id)
        if batch is None:
            return
        batch.compute_done = True
        batch.done_at = time.monotonic()
        if msg.working_bytes is not None:
            self._measured(batch, msg.working_bytes, msg.working_batch or len(batch.items))
        self.metrics.stage_seconds.labels("compute").observe(msg.compute_ms / 1000)
        for item in batch.items:
            # this batch's versions, on each of its outputs: the job's other outputs may run in other
            # batches, either side of an update (a batch itself never mixes: updates apply between forwards)
            item.lora_versions, item.weight_versions = dict(msg.lora_versions), dict(msg.weight_versions)
            if not item.job.terminal and item.stage <= Stage.COMPUTING:
                item.stage = Stage.COPYING
                item.job.add_timing("compute", msg.compute_ms)
        self._leave_compute(batch)

    def _measured(self, batch: Batch, working_bytes: int, ran: int) -> None:
        """The worker measured the batch's working memory: residency plans with it from now on, and
        the state dir keeps it (filed as the model's capabilities are) for the next start."""
        req = batch.items[0].job.request
        name = batch.worker.config.model_name
        entry = self.keeper.policy.measured(name, shape_of(*req.work_size, ran, req.num_frames), working_bytes)
        model = self.pool.models.get(name)
        if entry is not None and model is not None:
            self.store.remember_working(model_key(model), entry)

    def on_output(self, worker: WorkerLink, item: Item | None, msg: OutputReady) -> None:
        """An output of a batch landed: hand it to the outputs, or straight back when its job has
        ended or it came twice."""
        batch = self.batches.get(msg.batch_id)
        if item is None or item.job.terminal or item.desc is not None or item.delivered:
            self.outputs.drop_late(worker, msg.tensor)
            if msg.trajectory is not None:
                self.outputs.drop_late(worker, msg.trajectory.region)
        else:
            if batch is not None and batch.done_at:
                copy_ms = (time.monotonic() - batch.done_at) * 1000
                item.job.add_timing("copy", copy_ms)
                self.metrics.stage_seconds.labels("copy").observe(copy_ms / 1000)
            self.outputs.deliver(item, msg.tensor, msg.trajectory)
        self.item_closed(msg.batch_id)

    def item_closed(self, batch_id: int) -> None:
        batch = self.batches.get(batch_id)
        if batch is None:
            return
        batch.open_items -= 1
        if batch.open_items <= 0:
            del self.batches[batch_id]
            self._finished(batch)
            if not batch.compute_done:
                self._leave_compute(batch)

    def lost(self, worker: WorkerLink) -> list[Item]:
        """A worker ended: forget its batches, and return the items it had not delivered. A worker the engine
        killed for a batch no job wanted (``jobs_ended``) ran nothing else of use: the items of its other batches
        (the one behind, which may have started as the kill went out) go back to the head of the queue, for the
        worker that replaces it or another, instead of failing with it. So do those of a worker that
        exited between two batches (a live update failed half-way in it: ``Fatal.between_batches``): the batches
        behind the update never started."""
        undelivered, requeue = [], []
        orphan = self._orphans_killed.pop(worker, None)
        between = bool(getattr(worker, "fatal_between_batches", False))
        for batch in list(self.batches.values()):
            if batch.worker is not worker:
                continue
            open_items = [i for i in batch.items if not i.job.terminal and not i.delivered]
            if between or (orphan is not None and batch.id != orphan):  # run again from the start: none delivered
                requeue += open_items
            else:
                undelivered += open_items
            del self.batches[batch.id]
            self._finished(batch)
        self.in_flight.pop(worker, None)
        for item in requeue:
            item.worker, item.batch_id, item.stage = None, None, Stage.QUEUED
        if requeue:
            self.scheduler.requeue_front(requeue)
        return undelivered

    def departed(self, workers: Iterable[WorkerLink]) -> None:
        """Workers gone (stopped on purpose, or lost): their empty queues go. One stopped on purpose is never
        ``lost``, and kept its entry for the daemon's life (a trainer sleeping at level 2 each round added one a
        round). A queue with batches in it stays for ``lost``, which ends or requeues them."""
        for w in workers:
            if not self.in_flight.get(w, True):
                del self.in_flight[w]

    # a batch whose jobs all ended, which its worker still computes ----------------------
    def jobs_ended(self, workers: Iterable[WorkerLink]) -> None:
        """Jobs running on ``workers`` ended (cancelled, past their deadline), and each was told. A worker sees
        it at its next step, but one step of a large forward can take minutes (a 4000² edit on a small model
        took over ten), while the model serves no one: a worker whose computing batch serves no job
        ``orphan_grace_s`` later, while other jobs wait for its model, is killed, and the pool replaces it. With
        none waiting it is left to finish (a decode or a compile has no step to stop at, and a reload of a large
        model can cost more than it saves), and looked at again a grace later."""
        grace = self.pool.config.orphan_grace_s
        if grace <= 0:
            return
        for worker in workers:
            batch = self._orphaned(worker)
            if batch is not None and batch.id not in self._orphan_timers:  # one timer a batch
                self._orphan_timers.add(batch.id)
                asyncio.get_running_loop().call_later(grace, self._kill_orphaned, worker, batch, grace)

    def _orphaned(self, worker: WorkerLink) -> Batch | None:
        queue = self.in_flight.get(worker)
        batch = queue[0] if queue else None
        if batch is None or not batch.computing or batch.compute_done:
            return None
        return batch if all(i.job.terminal for i in batch.items) else None

    def _kill_orphaned(self, worker: WorkerLink, batch: Batch, grace: float) -> None:
        if self._orphaned(worker) is not batch or worker.state != WorkerState.READY:
            self._orphan_timers.discard(batch.id)
            return  # it finished the batch, or it is gone already
        name = worker.config.model_name
        behind = self.scheduler.outputs(name) + sum(not i.job.terminal for b in self.in_flight[worker] if b is not batch
                                                    for i in b.items)
        if not behind:  # no one waits for the model: let it finish, and look again
            asyncio.get_running_loop().call_later(grace, self._kill_orphaned, worker, batch, grace)
            return
        self._orphan_timers.discard(batch.id)
        jobs = ", ".join(sorted({i.job.id for i in batch.items}))
        log.warning("%s still computes batch %d at least %.0f s after its jobs ended (%s), while %d outputs wait "
                    "for %s: killing it so that the model serves again (a step is not interrupted mid-way; the "
                    "pool starts another worker; --orphan-grace-s sets the wait)", worker.name, batch.id, grace, jobs,
                    behind, name)
        self._orphans_killed[worker] = batch.id
        worker.kill()

    def _finished(self, batch: Batch) -> None:
        name = batch.worker.config.model_name
        asked = [i.job.request.keep_alive_s for i in batch.items]
        if self.keeper.known(name):  # batch_finished ignores a model it does not know
            policy = self.keeper.policy
            keep = longest_keep_alive(asked, lambda a: policy.keep_alive_for(name, a))
        else:
            keep = asked[0]
        self.keeper.batch_finished(name, _shape(batch.items), keep, batch.worker.config.device)

    def batches_in_flight(self, worker: WorkerLink) -> int:
        return len(self.in_flight.get(worker, ()))


def longest_keep_alive(asked: Iterable[float | None], effective: Callable[[float | None], float]) -> float | None:
    """The keep-alive a batch leaves its model with: its jobs' longest, as Ollama keeps a model for the
    longest any client asked, so a job that asks ``0`` does not send a model away under one that asked
    ``1h`` and shared its batch. ``effective`` says what each value means for this model (``None``: the
    model's own, a request's: capped by ``--max-keep-alive``); the value returned is one a job asked for,
    so the cap is applied once, where it always is (``Residency.touch``)."""
    return max(asked, key=effective)


def _shape(items: list[Item]) -> Shape:
    req = items[0].job.request
    return shape_of(*req.work_size, len(items), req.num_frames)


def _jobs_of(items: Iterable[Item]) -> list[Job]:
    return list({i.job.id: i.job for i in items if not i.job.terminal}.values())


def _preview_fields(req: JobRequest) -> dict[str, int]:
    """The worker's share of a request's previews (encoding them is the engine's)."""
    p = req.preview
    return {} if p is None else {"preview_every": p.every, "preview_max_side": p.max_side}
