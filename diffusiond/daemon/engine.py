"""The engine: one event loop that owns every job, every worker and every output.

Single-threaded state: all mutations happen on the loop, so there are no locks and no races
between "an output arrived" and "someone started waiting for it". Frames from workers land on
the Job that was created at admission; encoders run in a thread pool and report back to the
loop. Every path a job can take ends in ``_end``, which releases whatever the job still holds.

It is longer than the other modules on purpose: every transition of a job, a batch or a worker
is here, so the invariants (nothing lost, nothing left hanging) can be checked in one file.
Encoding and serving outputs (``outputs.py``), queueing (``scheduler.py``) and the worker
processes (``worker_handle.py``) live apart.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from diffusiond import __version__
from diffusiond.daemon.config import DaemonConfig, ModelConfig
from diffusiond.daemon.errors import ApiError
from diffusiond.daemon.jobs import Item, Job, JobRequest, Stage, Status
from diffusiond.daemon.metrics import Metrics
from diffusiond.daemon.outputs import Outputs
from diffusiond.daemon.scheduler import QueueFull, Scheduler, Wait
from diffusiond.daemon.worker_handle import WorkerHandle, WorkerStartError
from diffusiond.ipc.frames import Frame
from diffusiond.ipc.messages import (
    Capabilities,
    ComputeDone,
    Execute,
    OutputReady,
    Progress,
    RequestEnded,
    RequestSpec,
    Sleep,
    SlotWait,
    Trace,
    Wake,
    WorkerConfig,
)

log = logging.getLogger(__name__)

MAX_BATCHES_PER_WORKER = 2  # one computing, one waiting: the GPU never waits for the engine
PING_INTERVAL_S = 1.0


@dataclass(eq=False)
class Batch:
    id: int
    worker: WorkerHandle
    items: list[Item]
    open_items: int
    computing: bool = False
    compute_done: bool = False
    done_at: float = 0.0


@dataclass(eq=False)
class Model:
    config: ModelConfig
    workers: list[WorkerHandle] = field(default_factory=list)
    capabilities: Capabilities = field(default_factory=Capabilities)  # generic until the first READY
    restarts: int = 0
    crash_streak: int = 0  # consecutive workers that died within a minute of starting
    replacing: int = 0  # replacements under way: jobs are still accepted and wait for them

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def task(self) -> str:
        return self.capabilities.task

    @property
    def state(self) -> str:
        states = {w.state for w in self.workers}
        for s in ("ready", "sleeping", "starting"):
            if s in states:
                return s
        return "unavailable"


class Engine:
    def __init__(self, config: DaemonConfig, metrics: Metrics | None = None) -> None:
        self.config = config
        self.metrics = metrics or Metrics()
        self.models = {m.name: Model(m) for m in config.models}
        self.jobs: dict[str, Job] = {}
        self.items: dict[str, Item] = {}
        self.batches: dict[int, Batch] = {}
        self.in_flight: dict[WorkerHandle, collections.deque[Batch]] = {}
        self.scheduler = Scheduler(queue_size=config.queue_size, max_batch=config.max_batch,
                                   batch_wait_s=config.batch_wait_ms / 1000)
        self.executor = ThreadPoolExecutor(config.encode_threads, thread_name_prefix="encode")
        self.outputs = Outputs(self, self.executor)
        self.accepting = False
        self.draining = False
        self.paused = False  # sleeping or on the way there: nothing is dispatched
        self.stopping = False
        self.started_at = time.time()
        self._batch_ids = 0
        self._worker_ids = 0
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._changed = asyncio.Event()
        # sleep and wake run one at a time, in the order they came: a wake that arrives while a sleep
        # is still draining must not finish first and then be undone by that sleep's SLEEP commands
        self._power = asyncio.Lock()
        self.metrics.bind(self.snapshot)
        for name in self.models:  # export restarts 0 from the start: a missing series is not a zero
            self.metrics.worker_restarts.labels(name)

    # lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start every worker; fail with the first worker's reason if a model cannot load."""
        starts = []
        for model in self.models.values():
            for device in model.config.devices:
                starts.append(self._start_worker(model, device))
        results = await asyncio.gather(*starts, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]
        self.accepting = True
        heartbeat = asyncio.ensure_future(self._heartbeat())
        self._tasks.add(heartbeat)

    async def _heartbeat(self) -> None:
        """Ping every worker each second: a lost frame shows up as a sequence gap within a second,
        and /health can tell a live worker from a wedged one."""
        while not self.stopping:
            await asyncio.sleep(PING_INTERVAL_S)
            for model in self.models.values():
                for w in model.workers:
                    with contextlib.suppress(Exception):
                        w.ping()

    def _new_handle(self, model: Model, device: str, *, replacement: bool = False) -> WorkerHandle:
        self._worker_ids += 1
        wc = WorkerConfig(
            worker_id=self._worker_ids - 1,
            model_name=model.name,
            model_spec=model.config.spec,
            device=device,
            dtype=model.config.dtype,
            output_mode=self.config.output_mode,  # type: ignore[arg-type]
            arena_bytes=self.config.arena_mb << 20,
            slot_timeout_s=self.config.slot_timeout_s,
            drain_timeout_s=self.config.drain_grace_s,
            options=dict(model.config.options),
            trace_gpu=self.config.trace,
            fault="" if replacement else self.config.fault,  # test faults hit first workers only
        )
        return WorkerHandle(wc, on_frame=self._on_frame, on_lost=self._on_lost,
                            log_level=self.config.log_level.upper(), env=self._thread_env(device))

    def _thread_env(self, device: str) -> dict[str, str]:
        """CPU workers share the cores: each gets its share of math threads, so N workers do
        not run N x cores threads (oversubscribed BLAS can be ten times slower, not N times)."""
        if device != "cpu" or "OMP_NUM_THREADS" in os.environ:
            return {}
        cpu_workers = sum(m.config.devices.count("cpu") for m in self.models.values())
        return {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // max(1, cpu_workers)))}

    async def _start_worker(self, model: Model, device: str, replacing: WorkerHandle | None = None) -> None:
        handle = self._new_handle(model, device, replacement=replacing is not None)
        if replacing is not None and replacing in model.workers:
            model.workers[model.workers.index(replacing)] = handle
        else:
            model.workers.append(handle)
        self.in_flight[handle] = collections.deque()
        try:
            ready = await handle.start(self.config.worker_start_timeout_s)
        except BaseException:
            # put things back as they were: the caller decides whether to try again
            self.in_flight.pop(handle, None)
            if replacing is not None:
                model.workers[model.workers.index(handle)] = replacing
            else:
                model.workers.remove(handle)
            raise
        model.capabilities = ready.capabilities
        if self.paused:
            await handle.command(Sleep(), self.config.drain_grace_s)
        self.dispatch()

    async def drain(self, grace: float) -> None:
        """Stop admitting; give accepted jobs ``grace`` seconds to finish; fail what is left."""
        self.accepting = False
        self.draining = True
        deadline = time.monotonic() + grace
        while any(not j.terminal for j in self.jobs.values()) and time.monotonic() < deadline:
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), max(0.0, deadline - time.monotonic()))
        for job in [j for j in self.jobs.values() if not j.terminal]:
            self._end(job, Status.FAILED, "shutting_down",
                      f"the daemon shut down before the job finished (grace period {grace:g}s, stage "
                      f"{job.stage.label})")

    async def stop(self) -> None:
        self.stopping = True
        handles = [w for m in self.models.values() for w in m.workers]
        await asyncio.gather(*(w.stop(self.config.drain_grace_s) for w in handles), return_exceptions=True)
        for t in list(self._tasks):
            t.cancel()
        for job in list(self.jobs.values()):
            self.outputs.release_all(job)
        self.executor.shutdown(wait=True, cancel_futures=True)

    async def sleep(self) -> None:
        """Drain the workers, then have each move its weights off the device."""
        async with self._power:
            self.paused = True
            await self._wait_idle(self.config.drain_grace_s)
            acks = await asyncio.gather(
                *(w.command(Sleep(), self.config.drain_grace_s) for m in self.models.values() for w in m.workers
                  if w.state == "ready"), return_exceptions=True)
        bad = [a for a in acks if isinstance(a, BaseException) or not a.ok]
        if bad:
            raise ApiError(500, "sleep_failed", f"sleep failed on {len(bad)} worker(s): {bad[0]}")

    async def wake(self) -> None:
        async with self._power:
            acks = await asyncio.gather(
                *(w.command(Wake(), self.config.worker_start_timeout_s) for m in self.models.values()
                  for w in m.workers if w.state == "sleeping"), return_exceptions=True)
            self.paused = False
            self.dispatch()
        bad = [a for a in acks if isinstance(a, BaseException) or not a.ok]
        if bad:
            raise ApiError(500, "wake_failed", f"wake failed on {len(bad)} worker(s): {bad[0]}")

    def _busy(self) -> bool:
        """Work that has left the queue and not yet come back: a batch still open (computing or
        copying; it closes when its last output lands) or an output still encoding. Sleep waits
        for all of it, so that when it answers nothing is running."""
        return bool(self.batches) or any(
            i.stage == Stage.ENCODING for j in self.jobs.values() if not j.terminal for i in j.items
        )

    async def _wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self._busy() and time.monotonic() < deadline:
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), max(0.0, deadline - time.monotonic()))

    async def trace(self) -> list[dict[str, Any]]:
        """Each ready worker's timeline (``--trace``): host events, and CUDA-timed ones on a GPU."""
        handles = [w for m in self.models.values() for w in m.workers if w.state == "ready"]
        acks = await asyncio.gather(*(w.command(Trace(), 30.0) for w in handles), return_exceptions=True)
        out = []
        for w, ack in zip(handles, acks, strict=True):
            if isinstance(ack, BaseException):
                raise ApiError(503, "worker_unavailable", f"{w.name} did not send its trace: {ack}")
            out.append({"id": w.id, "pid": w.pid, "model": w.config.model_name, "device": w.config.device,
                        "events": [[e.name, e.batch_id, e.t_ns] for e in ack.trace],
                        "gpu_events": [[e.name, e.batch_id, e.t_ns] for e in ack.gpu_trace]})
        return out

    # admission ------------------------------------------------------------------------------
    def model(self, name: str | None) -> Model:
        if name is None:
            return next(iter(self.models.values()))
        try:
            return self.models[name]
        except KeyError:
            raise ApiError(404, "model_not_found",
                           f"model {name!r} is not served here; models: {', '.join(self.models)}",
                           field="model") from None

    def submit(self, req: JobRequest, *, sync: bool = False) -> Job:
        if not self.accepting:
            reason = "draining for shutdown" if self.draining else "starting"
            self.metrics.rejected_total.labels("unavailable").inc()
            raise ApiError(503, "unavailable", f"the daemon is {reason}; not accepting jobs",
                           headers={"Retry-After": "5"})
        model = self.models[req.model]
        if model.state == "unavailable" and not model.replacing and not any(w.state == "starting"
                                                                            for w in model.workers):
            raise ApiError(503, "no_worker", f"model {model.name!r} has no running worker")
        job = Job(req, sync=sync)
        base = req.seed if req.seed is not None else random.randrange(2**31)
        job.items = [Item(job, i, seed=base + i) for i in range(req.n)]
        try:
            self.scheduler.admit(job)
        except QueueFull as exc:
            self.metrics.rejected_total.labels("queue_full").inc()
            raise ApiError(429, "queue_full", f"{exc}; retry later", headers={"Retry-After": "1"}) from None
        self.jobs[job.id] = job
        for item in job.items:
            self.items[item.request_id] = item
        timeout = req.timeout_s or self.config.job_timeout_s
        job.deadline = asyncio.get_running_loop().call_later(timeout, self._on_deadline, job, timeout)
        self.dispatch()
        return job

    def cancel(self, job_id: str) -> Job:
        job = self.get(job_id)
        if job.terminal:
            raise ApiError(409, "job_finished", f"job {job_id} already finished ({job.status.value})")
        self._end(job, Status.CANCELLED, "cancelled", "cancelled by the client")
        return job

    def get(self, job_id: str) -> Job:
        try:
            return self.jobs[job_id]
        except KeyError:
            raise ApiError(404, "job_not_found", f"no job {job_id!r} (unknown, or its retention ended)") from None

    # dispatch -------------------------------------------------------------------------------
    def dispatch(self) -> None:
        if self.paused or self.stopping:
            return
        now = time.monotonic()
        wake_at: float | None = None
        for model in self.models.values():
            while True:
                ready = [w for w in model.workers if w.state == "ready"
                         and len(self.in_flight[w]) < MAX_BATCHES_PER_WORKER]
                if not ready:
                    break
                worker = min(ready, key=lambda w: len(self.in_flight[w]))
                # An idle worker takes whatever is there; a busy one only a full batch (see Scheduler).
                got = self.scheduler.next_batch(model.name, now, partial_ok=not self.in_flight[worker])
                if got is None:
                    break
                if isinstance(got, Wait):
                    wake_at = got.until if wake_at is None else min(wake_at, got.until)
                    break
                self._send(worker, got)
        if wake_at is not None:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = asyncio.get_running_loop().call_at(
                asyncio.get_running_loop().time() + max(0.0, wake_at - now), self.dispatch)

    def _send(self, worker: WorkerHandle, items: list[Item]) -> None:
        self._batch_ids += 1
        batch = Batch(self._batch_ids, worker, items, open_items=len(items))
        req = items[0].job.request
        msg = Execute(batch.id, req.batch_params(), [
            RequestSpec(request_id=i.request_id, prompt=i.job.request.prompt, seed=i.seed,
                        negative_prompt=i.job.request.negative_prompt) for i in items])
        try:
            worker.execute(msg)
        except Exception as exc:
            log.warning("could not send batch to %s: %s", worker.name, exc)
            self.scheduler.requeue_front(items)
            return
        self.batches[batch.id] = batch
        for i in items:
            i.worker, i.batch_id = worker, batch.id
        self.metrics.batch_size.observe(len(items))
        queue = self.in_flight[worker]
        queue.append(batch)
        if len(queue) == 1:
            self._start_computing(batch)

    def _start_computing(self, batch: Batch) -> None:
        batch.computing = True
        now = time.monotonic()
        for item in batch.items:
            if item.job.terminal:
                continue
            item.stage = Stage.COMPUTING
            job = item.job
            if job.status == Status.QUEUED:
                job.status = Status.RUNNING
                queued_ms = (now - job.t0) * 1000
                job.add_timing("queued", queued_ms)
                self.metrics.stage_seconds.labels("queued").observe(queued_ms / 1000)
                job.emit("status", job.to_json())

    def _leave_compute(self, batch: Batch) -> None:
        """The worker is done computing ``batch``: the next one it holds is now computing."""
        queue = self.in_flight.get(batch.worker)
        if queue and batch in queue:
            queue.remove(batch)
            if queue and not queue[0].computing:
                self._start_computing(queue[0])
        self._changed.set()
        self.dispatch()

    # frames from workers --------------------------------------------------------------------
    def _on_frame(self, worker: WorkerHandle, frame: Frame) -> None:
        msg = frame.msg
        if isinstance(msg, OutputReady):
            self._on_output(worker, msg)
        elif isinstance(msg, Progress):
            batch = self.batches.get(msg.batch_id)
            for job in {i.job.id: i.job for i in batch.items}.values() if batch else ():
                if not job.terminal:
                    job.progress = (msg.step, msg.total)
                    job.emit("progress", {"step": msg.step, "total": msg.total})
        elif isinstance(msg, ComputeDone):
            batch = self.batches.get(msg.batch_id)
            if batch is None:
                return
            batch.compute_done = True
            batch.done_at = time.monotonic()
            self.metrics.stage_seconds.labels("compute").observe(msg.compute_ms / 1000)
            for item in batch.items:
                if not item.job.terminal and item.stage <= Stage.COMPUTING:
                    item.stage = Stage.COPYING
                    item.job.add_timing("compute", msg.compute_ms)
            self._leave_compute(batch)
        elif isinstance(msg, SlotWait):
            log.info("%s waits for %d bytes of arena (%d of %d in use); spilling unfetched outputs",
                     worker.name, msg.nbytes, msg.in_use, msg.capacity)
            self.outputs.relieve(worker, need=msg.nbytes - (msg.capacity - msg.in_use))
        elif isinstance(msg, RequestEnded):
            item = self.items.get(msg.request_id)
            if item is not None and not item.job.terminal:
                if msg.status == "failed":
                    self._end(item.job, Status.FAILED, "generation_failed",
                              f"{msg.message} (on {worker.name})", stage=msg.stage)
                else:  # the worker cancelled it on our behalf (only after we asked)
                    self._end(item.job, Status.CANCELLED, "cancelled", msg.message)
            self._item_closed(msg.batch_id)

    def _on_output(self, worker: WorkerHandle, msg: OutputReady) -> None:
        item = self.items.get(msg.request_id)
        batch = self.batches.get(msg.batch_id)
        if item is None or item.job.terminal or item.desc is not None:
            worker.release(msg.tensor)  # a late output of a job that ended: give the slot back now
        else:
            item.desc = msg.tensor
            item.stage = Stage.ENCODING
            if batch is not None and batch.done_at:
                copy_ms = (time.monotonic() - batch.done_at) * 1000
                item.job.add_timing("copy", copy_ms)
                self.metrics.stage_seconds.labels("copy").observe(copy_ms / 1000)
            self.outputs.deliver(item)
        self._item_closed(msg.batch_id)

    def _item_closed(self, batch_id: int) -> None:
        batch = self.batches.get(batch_id)
        if batch is None:
            return
        batch.open_items -= 1
        if batch.open_items <= 0:
            del self.batches[batch_id]
            if not batch.compute_done:
                self._leave_compute(batch)

    def item_ready(self, item: Item) -> None:
        """Called by Outputs when an item's output can be served."""
        item.done = True
        item.stage = Stage.DONE
        job = item.job
        if all(i.done for i in job.items):
            self._end(job, Status.SUCCEEDED)
        else:
            job.emit("status", job.to_json())
            self._changed.set()

    def item_failed(self, item: Item, message: str, stage: Stage) -> None:
        self._end(item.job, Status.FAILED, "output_failed", message, stage=stage.label)

    # endings --------------------------------------------------------------------------------
    def _end(self, job: Job, status: Status, code: str = "", message: str = "", stage: str | None = None) -> None:
        stage_label = stage or job.stage.label
        error = None if status == Status.SUCCEEDED else {"code": code, "message": message, "stage": stage_label}
        if not job.end(status, error):
            return
        self.scheduler.remove(job)
        cancels: dict[WorkerHandle, list[str]] = collections.defaultdict(list)
        for item in job.items:
            if status != Status.SUCCEEDED:
                if item.worker is not None and not item.done and item.desc is None:
                    cancels[item.worker].append(item.request_id)
                self.outputs.release(item)
        for worker, ids in cancels.items():
            with contextlib.suppress(Exception):
                worker.cancel(ids)
        self.metrics.jobs_total.labels(status.value).inc()
        if status != Status.SUCCEEDED:
            log.info("job %s %s: %s", job.id, status.value, message)
        loop = asyncio.get_running_loop()
        loop.call_later(self.config.retention_s, self._expire, job.id)
        self._changed.set()

    def _on_deadline(self, job: Job, timeout: float) -> None:
        job.deadline = None
        stage = job.stage.label
        where = f" on {', '.join(job.workers())}" if job.workers() else ""
        self._end(job, Status.FAILED, "deadline_exceeded",
                  f"job {job.id} passed its deadline of {timeout:g}s while {stage}{where}", stage=stage)

    def _expire(self, job_id: str) -> None:
        job = self.jobs.pop(job_id, None)
        if job is None:
            return
        self.outputs.release_all(job)
        for item in job.items:
            self.items.pop(item.request_id, None)

    def _on_lost(self, worker: WorkerHandle, reason: str) -> None:
        """A worker ended: fail what it was working on (not what it already delivered), replace it."""
        log.error("%s", reason)
        for batch in list(self.batches.values()):
            if batch.worker is not worker:
                continue
            for item in batch.items:
                if not item.job.terminal and item.desc is None and not item.done:
                    self._end(item.job, Status.FAILED, "worker_lost",
                              f"{reason} while the job was {item.stage.label}", stage=item.stage.label)
            del self.batches[batch.id]
        self.in_flight.pop(worker, None)
        self._changed.set()
        if self.stopping:
            return
        model = self.models[worker.config.model_name]
        model.restarts += 1
        self.metrics.worker_restarts.labels(model.name).inc()
        model.replacing += 1  # now, not when the task starts: admission must see it at once
        task = asyncio.ensure_future(self._restart(model, worker))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _restart(self, model: Model, old: WorkerHandle) -> None:
        """Replace ``old`` after a back-off that grows while workers keep dying young (a crash
        loop must not spin) and starts over once one has lived a minute."""
        backoff = self.config.restart_backoff_s
        model.crash_streak = model.crash_streak + 1 if time.monotonic() - old.started_at < 60 else 0
        attempt = model.crash_streak
        try:
            while not self.stopping:
                await asyncio.sleep(backoff[min(attempt, len(backoff) - 1)])
                try:
                    await self._start_worker(model, old.config.device, replacing=old)
                    log.info("replaced %s", old.name)
                    return
                except (WorkerStartError, OSError) as exc:
                    log.error("restarting a worker for %s failed: %s", model.name, exc)
                    attempt += 1
        finally:
            model.replacing -= 1

    # views ----------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        by_status: dict[str, int] = dict.fromkeys((s.value for s in Status), 0)
        for j in self.jobs.values():
            by_status[j.status.value] += 1
        return {
            "version": __version__,
            "status": "ok" if all(m.state == "ready" or self.paused for m in self.models.values()) else "degraded",
            "accepting": self.accepting,
            "sleeping": self.paused,
            "queue_depth": self.scheduler.depth,
            "jobs": by_status,
            "workers": [
                {"id": w.id, "model": m.name, "device": w.config.device, "state": w.state, "pid": w.pid,
                 "answering": w.answering(3 * PING_INTERVAL_S + 1),
                 "restarts": m.restarts, "batches_in_flight": len(self.in_flight.get(w, ())),
                 "arena_bytes": w.arena_capacity, "arena_bytes_in_use": w.held_bytes}
                for m in self.models.values() for w in m.workers
            ],
            "arena_bytes_in_use": sum(w.held_bytes for m in self.models.values() for w in m.workers),
        }
