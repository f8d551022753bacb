"""The engine core: one event loop that owns every job, from admission to its one ending.

Single-threaded state: all mutations happen on the loop, so there are no locks and no races
between "an output arrived" and "someone started waiting for it". A Job exists from admission;
frames from workers land on it in whatever order they come. Every path a job can take ends in
``_end``, which tells the outputs module to give back whatever the job still holds.

What is not here: batches on their way through a worker (``flights.py``), queueing rules
(``scheduler.py``), which workers exist and keeping them alive (``workers/pool.py``), slots,
encoding and reading outputs (``outputs/slots.py``), previews (``outputs/previews.py``), LoRA
registration (``loras.py``), the state dir (``state/store.py``) and finished jobs looked up later
(``state/history.py``), and HTTP (``edge/status.py`` picks status codes for the domain errors raised
here; ``edge/views.py`` draws the JSON).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import time
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from diffusiond.daemon.config import DaemonConfig
from diffusiond.daemon.core import endings, power, resume, unrunnable
from diffusiond.daemon.core.controls import ControlRegistry
from diffusiond.daemon.core.file_checks import FileChecks
from diffusiond.daemon.core.flights import Flights
from diffusiond.daemon.core.ip_adapters import IpAdapterRegistry
from diffusiond.daemon.core.jobs import Item, Job, JobRequest
from diffusiond.daemon.core.loras import LoraInfo, LoraRegistry
from diffusiond.daemon.core.output_access import OutputAccess
from diffusiond.daemon.core.scheduler import Scheduler
from diffusiond.daemon.core.upscalers import UpscalerRegistry
from diffusiond.daemon.core.weights import LiveComponents, LiveLoras
from diffusiond.daemon.errors import EngineError, JobFinished, ModelTooLarge, NotAccepting, NoWorker, QueueFull
from diffusiond.daemon.metrics import Metrics
from diffusiond.daemon.outputs.previews import Previews
from diffusiond.daemon.outputs.slots import Outputs
from diffusiond.daemon.residency.keeper import Keeper, shape_of
from diffusiond.daemon.residency.ondemand import LoadFailed
from diffusiond.daemon.state.history import History
from diffusiond.daemon.state.store import Store
from diffusiond.daemon.workers.link import WorkerLink, WorkerStartError
from diffusiond.daemon.workers.pool import Model, Spawn, WorkerPool, spawn_process
from diffusiond.ipc.frames import Frame
from diffusiond.ipc.messages import (
    Ack,
    ComputeDone,
    LoadProgress,
    OutputReady,
    PreviewReady,
    Progress,
    RequestEnded,
    SlotWait,
)
from diffusiond.protocol import ErrorCode, Event, JobStatus, Stage

log = logging.getLogger(__name__)

class Engine(OutputAccess):
    def __init__(self, config: DaemonConfig, metrics: Metrics | None = None, *,
                 spawn: Spawn = spawn_process, store: Store | None = None) -> None:
        self.config = config
        self.metrics = metrics or Metrics()
        self.store = store or Store()  # where jobs outlive the process (store.py); by default nowhere
        self.loras = LoraRegistry(config.loras, config.max_loras)
        self.controls = ControlRegistry(config.controlnets)
        self.ip_adapters = IpAdapterRegistry(config.ip_adapters)
        self.upscalers = UpscalerRegistry(config.upscalers)  # read by spandrel at start (server.py)
        files = FileChecks.of(config, self.store.root)  # what updates for a model with no worker meet (issue 29)
        self.live_loras, self.live_components = LiveLoras(self.loras, files), LiveComponents(files)  # update_*
        self.pool = WorkerPool(config, self.metrics, on_frame=files.watching(self._on_frame), on_lost=self._on_lost,
                               on_ready=self._on_worker_ready, spawn=spawn, prepare=self._prepare_worker,
                               on_unreplaced=functools.partial(unrunnable.unreplaced, self))
        self.pool.lora_target_rank = self.loras.start_rank
        self.jobs: dict[str, Job] = {}
        self.items: dict[str, Item] = {}
        self.scheduler = Scheduler(queue_size=config.queue_size, max_batch=config.max_batch,
                                   batch_wait_s=config.batch_wait_ms / 1000,
                                   sizes={m.name: config.batch_sizes_of(m) for m in config.models})
        self._changed = asyncio.Event()
        self.executor = ThreadPoolExecutor(config.encode_threads, thread_name_prefix="encode")
        self.outputs = Outputs(self.executor, self.metrics, png_compress_level=config.png_compress_level,
                               on_ready=self._on_item_ready, on_failed=self._on_item_failed, store=self.store)
        self.keeper = Keeper(config, self.pool, self.metrics, on_change=self.dispatch, oldest=self.scheduler.oldest,
                             queued=self.scheduler.outputs, fail=functools.partial(unrunnable.fail_queued, self))
        self.flights = Flights(self.pool, self.scheduler, self.outputs, self.store, self.metrics,
                               held=lambda: self.paused or self.stopping, changed=self._changed, keeper=self.keeper,
                               unsendable=lambda item, why: self._end(item.job, JobStatus.FAILED,
                                                                      ErrorCode.GENERATION_FAILED, why, stage="queued"))
        self.previews = Previews(self.executor, self.metrics, on_preview=self._on_preview)
        self.history = History(config, self.jobs, self.store, self.outputs, cancel=self.cancel, expire=self._expire)
        self.accepting = False
        self.started = False  # the start's preload has ended (``keeper.preloading`` says what it still loads)
        self.draining = False
        self.stopping: bool = False
        self.started_at = time.time()
        # sleep and wake run one at a time, in the order they came: a wake that arrives while a sleep
        # is still draining must not finish first and then be undone by that sleep's SLEEP commands
        self._power = asyncio.Lock()
        self._slept: list[Model] = []  # the models on a device when a sleep began: its wake brings them back
        self._waiting: dict[int, str] = {}  # by worker id, the request whose copy last asked for arena room
        self._socket_activated = False  # the start's preload choice, which a wake makes again
        self._preloads: list[Model] = []  # what ``open`` chose for ``preload`` to load
        self._retention: asyncio.Task[None] | None = None
        self._pool_starting = False  # workers are being started: a model without one yet will have one
        self._suspended: set[str] = set()  # jobs a clean shutdown left to the next start (``_suspend``)

    @property
    def paused(self) -> bool:
        """Sleeping or on the way there: nothing is dispatched."""
        return self.pool.paused

    # lifecycle ------------------------------------------------------------------------------
    async def start(self, *, socket_activated: bool = False) -> None:
        """``open`` then ``preload``: what the server does, with READY=1 between them (issue 27)."""
        await self.open(socket_activated=socket_activated)
        await self.preload()

    async def open(self, *, socket_activated: bool = False) -> None:
        """Take back what the last run left unfinished and admit jobs (``/ready`` answers 200); the models the
        start loads (``residency/preload.py``; by default those that fit) are chosen now, for ``preload``."""
        await self.recover()
        self._socket_activated = socket_activated
        self._preloads = self.keeper.choose_preload(socket_activated)
        self.accepting = True
        if self.store.persistent and (self.config.keep_days or self.config.keep_gb):
            self._retention = asyncio.ensure_future(self.history.retain_forever())
        self._pool_starting = True
        self._changed.set()

    async def preload(self) -> None:
        """Load what ``open`` chose while jobs come: each model's READY dispatches those waiting for it. A
        model that fails to load stays on disk with its reason and fails its jobs; the start fails (with the
        first worker's reason) only when every model it tried failed, or when a LoRA adapter fits no model:
        then what was admitted meanwhile stays queued on disk (jobs that persist) or fails with the reason."""
        try:
            await self.keeper.preload(self._preloads)
            unfit = self.loras.unfit_at_start(self.models())
            if unfit:
                raise WorkerStartError(unfit)
            self.started = True
            self.keeper.started()
            # Jobs resumed or admitted while the models loaded, for a model the preload left on disk: no READY
            # of its will dispatch them, so they would wait for another model's event (with keep-alive -1, forever).
            self.dispatch()
        except WorkerStartError as exc:
            await self.drain(0, f"the daemon could not start: {exc}")
            raise
        except BaseException:
            self.accepting = False  # what was admitted stays queued (on disk, when jobs persist)
            raise
        finally:
            self._pool_starting = False
            self._changed.set()

    async def recover(self) -> None:
        await resume.recover(self)

    async def drain(self, grace: float, why: str | None = None, unloaded: Collection[str] = ()) -> None:
        await resume.drain(self, grace, why, unloaded)

    async def stop(self) -> None:
        self.stopping = True
        self._changed.set()
        self.keeper.stop()
        if self._retention is not None:
            self._retention.cancel()
        try:  # whatever the workers' stop raised, what outputs are being written lands and the store closes
            await self.pool.stop()
        finally:
            self.previews.close()
            self.outputs.close()
            await self.outputs.settled()  # before the pool it uses shuts
            await asyncio.get_running_loop().run_in_executor(  # off the loop: a file may still be being read
                None, functools.partial(self.executor.shutdown, wait=True, cancel_futures=True))
            await self.store.close()

    async def sleep(self, level: int = 1) -> dict[str, Any]:
        """Every model off its device through residency once running work ends (``power.py``): level 1 to host
        memory, level 2 to disk with its workers stopped (CUDA contexts freed, for a trainer's whole card).
        Carried to its end when its caller leaves (a client's timeout): cut short in its drain, it left the daemon
        paused at level 0 for good; a failure then is logged (``power.unread``)."""
        task = asyncio.ensure_future(power.locked(self._power, power.sleep(self, level)))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(power.unread)
            raise

    async def wake(self) -> None:
        """Jobs queued meanwhile run, and the models come back as the start's preload brought them."""
        async with self._power:
            await power.wake(self)

    def _busy(self) -> bool:
        """Work that has left the queue and not yet come back: a batch still open (computing or
        copying; it closes when its last output lands) or an output still encoding. Sleep waits
        for all of it, so that when it answers nothing is running."""
        return bool(self.flights.batches) or any(
            i.stage == Stage.ENCODING for j in self.jobs.values() if not j.terminal for i in j.items
        )

    async def _wait_until(self, done: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not done() and time.monotonic() < deadline:
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), max(0.0, deadline - time.monotonic()))

    async def trace(self) -> list[tuple[WorkerLink, Ack]]:
        return await self.pool.trace()

    # admission ------------------------------------------------------------------------------
    def model(self, name: str | None) -> Model:
        return self.pool.model(name)

    def models(self) -> list[Model]:
        return list(self.pool.models.values())

    async def described(self, name: str | None = None) -> None:
        """Wait until jobs are admitted (the state dir is read) and the model a request names (the
        first, by default) has its own defaults and limits (its first READY, or remembered from the
        last run), so a request that comes while models load is completed and checked the way it will
        run. A model never seen that waits on disk is loaded now, for this request (``Keeper.learn``):
        a 503 naming the model and the worker's reason when that load fails (``_unlearned``). Not waited
        for: a daemon that is stopping, a model whose workers could not start, or a name not served (the
        caller's ``model`` says 404)."""
        if name is not None and name not in self.pool.models:
            return
        model = self.pool.model(name)

        def settled() -> bool:
            if self.draining or self.stopping:
                return True
            return self.accepting and (model.known or model.retired
                                       or not (self._pool_starting or model.can_take_jobs()))

        await self._wait_until(settled, self.config.worker_start_timeout_s)
        unfit = bool(model.config.nothing_fits)  # refused at admission: no load to learn it
        if not model.known and model.retired and not unfit and not (self.draining or self.stopping):
            failed = await self.keeper.learn(model)
            if failed is not None:
                raise self._unlearned(model.name, failed)

    async def accept(self, req: JobRequest, *, sync: bool = False) -> Job:
        """Admit a job and return once it is recorded (on disk when jobs persist): what a 202 promises."""
        job = self.submit(req, sync=sync)
        try:  # recorded whatever the caller does: what is in memory is on disk
            await asyncio.shield(endings.admitted(self.store, job, self._end))
        except asyncio.CancelledError:
            if sync and not job.terminal:  # the client left (aiohttp cancels its handler): nobody will read it
                self._end(job, JobStatus.CANCELLED, ErrorCode.CANCELLED, "the client left before it was accepted")
            raise  # a job of /v1/jobs stays: it may have been the client's timeout, and listing finds it
        return job

    async def load_model(self, name: str) -> None:
        """By hand: the model onto its device now (``POST /v1/models/{name}/load``); refused as its jobs are
        when ``offload=auto`` found nothing that fits, and a load that fails answers with the worker's reason."""
        model = self.pool.model(name)
        if model.config.nothing_fits:
            raise ModelTooLarge(self.keeper.nothing_fits(model).reason, field="name")
        if not self.keeper.known(name) and model.retired:  # never seen: its first load places it
            failed = await self.keeper.learn(model)
            if failed is not None:
                raise self._unlearned(name, failed)
        try:
            await self.keeper.load(model)
        except ValueError as exc:
            raise ModelTooLarge(str(exc), field="name") from None
        except LoadFailed as exc:
            raise NoWorker(str(exc), code=ErrorCode.MODEL_LOAD_FAILED) from None
        except TimeoutError as exc:
            raise NoWorker(str(exc)) from None

    def _unlearned(self, name: str, failed: str) -> NoWorker:
        """A never-seen model's first load failed: ``model_load_failed`` with the worker's reason, as a known
        model's jobs fail; ``no_worker`` while a level-2 sleep lets no worker start (no load was tried)."""
        code = ErrorCode.NO_WORKER if self.pool.sleep_level >= 2 else ErrorCode.MODEL_LOAD_FAILED
        return NoWorker(f"model {name!r} could not be loaded: {failed}", code=code)

    async def unload_model(self, name: str) -> None:
        """By hand: the model off its device once its work is done (``POST /v1/models/{name}/unload``)."""
        await self.keeper.unload(self.pool.model(name), "unloaded by hand")

    def check_loras(self, model: str, loras: list[tuple[str, float]]) -> None:
        """Admission: the adapters a request names exist, fit its model, and are not too many."""
        self.loras.resolve(self.pool.model(model), loras)

    def check_controls(self, model: str, names: list[str]) -> None:
        """Admission: the ControlNets a request names are served and fit its model."""
        self.controls.resolve(self.pool.model(model), names)

    def check_ip_adapters(self, model: str, names: list[str]) -> None:
        """Admission: the IP-Adapters a request names are served and fit its model."""
        self.ip_adapters.resolve(self.pool.model(model), names)

    async def add_lora(self, name: str, path: str) -> LoraInfo:
        """Register an adapter at run time (admin): checked by every live worker against its model."""
        return await self.loras.add(name, path, self.models(), self.config.worker_start_timeout_s,
                                    self.pool.lora_paths)

    def submit(self, req: JobRequest, *, sync: bool = False) -> Job:
        """Admit a job (in memory; ``accept`` also records it)."""
        try:
            return self._submit(req, sync)
        except BaseException:
            req.close_inputs()  # refused: nobody else will close its input
            raise

    def _submit(self, req: JobRequest, sync: bool) -> Job:
        if not self.accepting:
            reason = "draining for shutdown" if self.draining else "starting"
            self.metrics.rejected_total.labels("unavailable").inc()
            raise NotAccepting(f"the daemon is {reason}; not accepting jobs", retry_after_s=5)
        model = self.pool.model(req.model)
        if not model.can_take_jobs() and not self._pool_starting:
            raise NoWorker(f"model {model.name!r} has no running worker")
        req = req.admitted(model.capabilities.flow_scheduler)
        eager = bool(req.controls or req.ip_adapters)  # such batches run eager on a compiled model (controlnet.eager)
        job = Job(req, sync=sync, approximations=model.capabilities.approximations,
                  compiled="" if eager else model.capabilities.compiled, attention=model.capabilities.attention)
        base = req.seed if req.seed is not None else random.randrange(2**31)
        job.items = [Item(job, i, seed=base + i) for i in range(req.n)]
        if self.scheduler.full:
            self.metrics.rejected_total.labels("queue_full").inc()
            raise QueueFull(f"the queue holds {self.scheduler.depth} jobs, its limit; retry later", retry_after_s=1)
        too_large = self.keeper.admit(model.name, shape_of(*req.work_size, 1, req.num_frames), req.n)
        if too_large is not None:
            self.metrics.rejected_total.labels("model_too_large").inc()
            raise ModelTooLarge(too_large.reason, field="model")
        self.scheduler.admit(job)
        self.jobs[job.id] = job
        for item in job.items:
            self.items[item.request_id] = item
        self._arm_deadline(job)
        self.dispatch()
        return job

    def _arm_deadline(self, job: Job) -> None:
        timeout = job.request.timeout_s or self.config.job_timeout_s
        job.deadline = asyncio.get_running_loop().call_later(timeout, self._on_deadline, job, timeout)

    def cancel(self, job_id: str) -> Job:
        job = self.get(job_id)
        if job.terminal:
            raise JobFinished(f"job {job_id} already finished ({job.status.value})")
        if job.id in self._suspended:  # ``_end`` leaves it as it is: a 200 cancelled nothing, the next start ran it
            raise NotAccepting(f"the daemon is shutting down and keeps job {job_id} in its state dir for its next "
                               "start, where it runs again: cancel it once the daemon is back",
                               code=ErrorCode.SHUTTING_DOWN)
        self._end(job, JobStatus.CANCELLED, ErrorCode.CANCELLED, "cancelled by the client")
        return job

    def recent(self, limit: int) -> list[Job]:
        return sorted(self.jobs.values(), key=lambda j: j.created, reverse=True)[:limit]

    def dispatch(self) -> None:
        self.flights.dispatch()

    # frames from workers --------------------------------------------------------------------
    async def _prepare_worker(self, model: Model, worker: WorkerLink) -> bool:
        """A worker that starts after live updates gets them before its first batch (core/weights.py); True
        when it failed half-way through one and exits."""
        timeout = self.config.worker_start_timeout_s
        exits = False
        try:
            exits = await self.live_loras.replay(model, worker, timeout) or \
                await self.live_components.replay(model, worker, timeout)
        except Exception:  # a worker lost meanwhile is replaced (and prepared) again: nothing to fail here
            log.exception("restoring live weights on %s failed", worker.name)
        # jobs admitted while the model ran no worker, naming an adapter this start refused, fail now as
        # admission would refuse them, not at run time with the worker's "not registered"
        for job in self.scheduler.waiting(model.name):
            try:
                self.loras.resolve(model, job.request.loras)
            except EngineError as err:
                self._end(job, JobStatus.FAILED, err.code, f"{err.message} (found when the model started, "
                          "after this job was queued)", stage=job.stage_label)
        return exits

    def _on_worker_ready(self, worker: WorkerLink) -> None:
        self.flights.worker_ready(worker)
        model = self.pool.models.get(worker.config.model_name)
        if model is not None:
            self.store.remember(resume.model_key(model), model.capabilities)
            self.keeper.worker_ready(model, worker.config.device)
        self._changed.set()
        self.dispatch()

    def _on_frame(self, worker: WorkerLink, frame: Frame) -> None:
        msg = frame.msg
        if isinstance(msg, OutputReady):
            self.flights.on_output(worker, self.items.get(msg.request_id), msg)
        elif isinstance(msg, Progress):
            self.flights.on_progress(msg)
        elif isinstance(msg, LoadProgress):
            self.keeper.load_progress(worker.config.model_name, worker.id, msg.bytes_loaded)
        elif isinstance(msg, PreviewReady):
            self.previews.deliver(worker, self.items.get(msg.request_id), msg)
        elif isinstance(msg, ComputeDone):
            self.flights.on_compute_done(msg)
        elif isinstance(msg, SlotWait):  # asked again every second while it waits: only its first ask is news
            level = logging.DEBUG if self._waiting.get(worker.id) == msg.request_id else logging.INFO
            self._waiting[worker.id] = msg.request_id
            log.log(level, "%s waits for %d bytes of arena (largest free range %d of %d); spilling unfetched outputs",
                    worker.name, msg.nbytes, msg.capacity - msg.in_use, msg.capacity)
            self.outputs.relieve(worker, need=msg.nbytes - (msg.capacity - msg.in_use), size=msg.nbytes)
        elif isinstance(msg, RequestEnded):
            ended = self.items.get(msg.request_id)
            if ended is not None and not ended.job.terminal:
                if msg.status == "failed":  # the worker's code (out_of_memory) where it gave one
                    code = ErrorCode(msg.code) if msg.code in set(ErrorCode) else ErrorCode.GENERATION_FAILED
                    self._end(ended.job, JobStatus.FAILED, code, f"{msg.message} (on {worker.name})", stage=msg.stage)
                else:  # the worker cancelled it on our behalf (only after we asked)
                    self._end(ended.job, JobStatus.CANCELLED, ErrorCode.CANCELLED, msg.message)
            self.flights.item_closed(msg.batch_id)

    def _on_item_ready(self, item: Item) -> None:
        item.stage = Stage.DONE
        job = item.job
        if all(i.done for i in job.items):
            self._end(job, JobStatus.SUCCEEDED)
        else:
            job.emit(Event.STATUS)
            self._changed.set()

    def _on_preview(self, item: Item) -> None:
        job = item.job
        job.last_preview = item.preview
        try:
            job.emit(Event.PREVIEW)
        finally:
            job.last_preview = None

    def _on_item_failed(self, item: Item, message: str, stage: Stage,
                        code: ErrorCode = ErrorCode.OUTPUT_FAILED) -> None:
        self._end(item.job, JobStatus.FAILED, code, message, stage=stage.label)

    # endings --------------------------------------------------------------------------------
    def _end(self, job: Job, status: JobStatus, code: ErrorCode | None = None, message: str = "",
             stage: str | None = None) -> None:
        if job.id in self._suspended and status != JobStatus.SUCCEEDED:  # left to the next start: its record stays
            return
        self._suspended.discard(job.id)  # done during the stop after all: the next start must not run it again
        stage_label = stage or job.stage_label
        error = None if status == JobStatus.SUCCEEDED else {"code": str(code), "message": message,
                                                            "stage": stage_label}
        if not job.end(status, error):
            return
        endings.record(self.store, job)  # listeners are told once it is on disk
        job.request.close_inputs()  # batches already sent hold their own fds
        self.scheduler.remove(job)
        self.keeper.unqueue(job.request.model, sum(1 for i in job.items if i.batch_id is None))
        if status != JobStatus.SUCCEEDED:
            endings.stop_work(job, self.outputs, self.flights)
            log.info("job %s %s: %s", job.id, status.value, message)
        self.metrics.jobs_total.labels(status.value).inc()
        asyncio.get_running_loop().call_later(self.config.retention_s, self._expire, job.id)
        self._changed.set()

    def _on_deadline(self, job: Job, timeout: float) -> None:
        job.deadline = None
        self._end(job, JobStatus.FAILED, ErrorCode.DEADLINE_EXCEEDED,
                  endings.deadline_passed(job, timeout, self.pool.sleep_level if self.paused else None))

    def _expire(self, job_id: str) -> None:
        job = self.jobs.pop(job_id, None)
        if job is None:
            return
        self.outputs.expire(job)
        for item in job.items:
            self.items.pop(item.request_id, None)

    def _on_lost(self, worker: WorkerLink, reason: str) -> None:
        """A worker ended: fail what it was working on (not what it already delivered)."""
        self.keeper.worker_lost(worker, reason)
        for item in self.flights.lost(worker):
            if not item.job.terminal:
                self._end(item.job, JobStatus.FAILED, ErrorCode.WORKER_LOST,
                          f"{reason} while the job was {item.stage.label}", stage=item.stage.label)
        self._changed.set()

    # what /health and /metrics read ---------------------------------------------------------
    def batches_in_flight(self, worker: WorkerLink) -> int:
        return self.flights.batches_in_flight(worker)

    def jobs_by_status(self) -> dict[str, int]:
        counts = dict.fromkeys((s.value for s in JobStatus), 0)
        for j in self.jobs.values():
            counts[j.status.value] += 1
        return counts
