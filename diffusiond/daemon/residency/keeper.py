"""Residency carried out: the policy (``policy.py``) decides, the keeper makes it happen through the pool.

The keeper is the engine's one door to residency. The engine tells it what jobs do (admitted,
started, finished, ended unrun) and asks it, before each dispatch, which models may take work
now; the keeper asks the policy, starts the moves it answers with, and reports each move's end
back to the policy, so the policy's picture is always what the workers really did. Every move is
logged with the policy's reason.

A move, by tier (one worker per model and device, as the pool starts them):
- device -> host: SLEEP the model's workers (weights wait in their host memory; see the worker);
- device or host -> disk: stop the model's workers (everything they held is freed, the CUDA
  context included); a job that needs the model again starts them anew;
- host -> device: WAKE; disk -> device: start the workers.

Load on demand: the start loads only the models ``preload.py`` chooses (by default those that fit);
every other model starts on disk with no worker at all, and its first job loads it. A model never
seen before (nothing remembered in the state dir) has no size or defaults yet: its first request
loads it (``learn``) and is completed and checked with what the worker then reports.

Turns (``turns.py``): before each dispatch the keeper tells the turns every model's standing, with the
admission time of its oldest queued output (the engine's scheduler knows it); a model held for another
takes no new batch, and once its batches are done it leaves its device for the model it yields to.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

import diffusiond.daemon.residency.batches as batches
import diffusiond.daemon.residency.byhand as byhand
import diffusiond.daemon.residency.leaving as leaving
import diffusiond.daemon.residency.ondemand as ondemand
from diffusiond.daemon.config import DaemonConfig
from diffusiond.daemon.metrics import Metrics
from diffusiond.daemon.residency.decisions import (
    LOADING,
    WAITING_FOR_MEMORY,
    WAITING_FOR_TURN,
    Evict,
    Fits,
    ModelStatus,
    Move,
    OomRetry,
    Plan,
    TooLarge,
    Wait,
)
from diffusiond.daemon.residency.fit import device_weights
from diffusiond.daemon.residency.load_reports import LoadReports
from diffusiond.daemon.residency.policy import Residency, ResidencyError
from diffusiond.daemon.residency.preload import Preloading
from diffusiond.daemon.residency.pressure import FreeReader, PressureWatch
from diffusiond.daemon.residency.too_large import past_budget, too_large_hints
from diffusiond.daemon.residency.turns import Ended, Hold, Standing, Turns
from diffusiond.daemon.residency.units import format_bytes
from diffusiond.daemon.residency.working import Shape
from diffusiond.daemon.workers.link import WorkerLink
from diffusiond.daemon.workers.pool import Asleep, Model, WorkerPool
from diffusiond.protocol import ErrorCode, WorkerState

log = logging.getLogger(__name__)

EXPIRY_CHECK_S = 0.5
"""How often keep-alives are looked at: a model leaves within this of its time."""


def shape_of(width: int, height: int, batch: int, frames: int | None) -> Shape:
    return Shape(width, height, batch, frames or 1)


class Keeper:
    def __init__(self, config: DaemonConfig, pool: WorkerPool, metrics: Metrics, *,
                 on_change: Callable[[], None], read_free: FreeReader | None = None,
                 oldest: Callable[[str], float | None] = lambda name: None,
                 queued: Callable[[str], int] = lambda name: 0,
                 fail: Callable[[str, str, ErrorCode, Shape | None], None] = lambda name, message, code, shape: None
                 ) -> None:
        """``oldest``: when a model's longest-waiting queued output was admitted (the scheduler's), or None;
        ``queued``: how many of its outputs the scheduler holds (counted when the model becomes known);
        ``fail``: fail the model's queued jobs with this message and code: its load failed, or it is too large;
        with a shape, only its jobs of that size (one output each): they no longer fit, and the others may."""
        self.config, self.pool, self.metrics = config, pool, metrics
        self.on_change = on_change  # a move ended: the engine dispatches again
        budgets = {}
        for device in dict.fromkeys(d for m in pool.models.values() for d in m.config.devices):
            budget = budgets[device] = config.budget_of(device)
            log.info("budget on %s: %s (%s)", device, format_bytes(budget.nbytes), budget.source)
        self.budget_sources = {d: b.source for d, b in budgets.items()}  # a refusal names where its budget came from
        self.policy = Residency({d: b.nbytes for d, b in budgets.items()}, config.host_memory_bytes,
                                keep_alive_s=config.keep_alive_s, max_keep_alive_s=config.max_keep_alive_s)
        self.moving: set[str] = set()
        self._expiry: asyncio.Task[None] | None = None
        self._moves: set[asyncio.Task[None]] = set()
        self.read_free = read_free  # tests: a fake NVML; None: NVML itself (residency/pressure.py)
        self.pressure: PressureWatch | None = None
        self._held: dict[str, str] = {}  # model -> the stage of the policy's last Wait for it
        self._short: dict[str, tuple[str, ...]] = {}  # model -> the devices that last Wait found short
        self._watch: asyncio.Task[None] | None = None
        self._learning: dict[str, asyncio.Task[str | None]] = {}  # model -> its first load (``learn``)
        self.turns = Turns(config.max_model_wait_s)
        self.oldest = oldest
        self.queued = queued
        self._asked: dict[str, Shape] = {}  # model -> the shape of the last batch it asked to run
        self.fail = fail
        self.failed: dict[str, str] = {}  # model -> why its last load failed; none is tried until a job asks
        self.unloads: dict[str, str] = {}  # model -> an unload by hand that waits for its work (``unload``)
        self._turn_timer: asyncio.TimerHandle | None = None
        self.loads = LoadReports()  # how far each model's load is (``load_progress``)
        self.preloading = Preloading()  # what the start's preload has yet to load (``/ready`` shows it)

    # what the engine tells ------------------------------------------------------------------------
    def started(self) -> None:
        self._expiry = asyncio.ensure_future(self._expire_forever())
        gpus = [d for m in self.pool.models.values() for d in m.config.devices if d.startswith("cuda")]
        if gpus:  # other programs come first: watch the GPUs' real free memory
            self.pressure = PressureWatch(self.policy, gpus, self.config.reserve_memory_bytes,
                                          move=self._spawn_moves, on_change=self.on_change, read=self.read_free)
            self._watch = asyncio.ensure_future(self.pressure.run())

    def stop(self) -> None:
        for task in (self._expiry, self._watch):
            if task is not None:
                task.cancel()
        if self._turn_timer is not None:
            self._turn_timer.cancel()

    def choose_preload(self, socket_activated: bool = False) -> list[Model]:
        return ondemand.choose_preload(self, socket_activated)

    async def preload(self, chosen: list[Model]) -> None:
        """``chosen`` onto their devices (``ondemand.preload``), while jobs are admitted (``preloading`` says)."""
        await ondemand.preload(self, chosen)

    def _register(self, model: Model) -> None:
        """The model becomes known to the policy: at its READY, or before its first load where its files' headers
        size it (``fit.device_weights``). Jobs admitted before (resumed from the state dir, or sent
        while its worker started) were not counted then: they are now, so it is not idle while they wait."""
        c = model.config
        if self.policy.has(model.name):
            if model.known and model.capabilities.weight_bytes:  # the worker's count over the files' estimate
                before = self.policy.resize(model.name, model.capabilities.weight_bytes, model.capabilities.host_bytes)
                for line in past_budget(model.name, c.devices, model.capabilities.weight_bytes, before,
                                        self.policy.budgets):
                    log.warning("%s", line)
            return
        on_cpu = c.devices[0].startswith("cpu")
        weights = model.capabilities.weight_bytes if model.known else device_weights(c.spec, c.options, c.dtype,
                                                                                      on_cpu=on_cpu)
        if weights is not None:  # else a hub id or preset: its first load tells (``learn``)
            hints = too_large_hints(c.spec, on_cpu, c.options, c.auto_placed)
            self.policy.add(model.name, c.devices, weights, pinned=c.pinned, keep_alive_s=c.keep_alive_s,
                            hints=hints, host_bytes=model.capabilities.host_bytes)
            waiting = self.queued(model.name)
            if waiting:
                self.policy.queue(model.name, waiting)

    def worker_ready(self, model: Model, device: str | None = None) -> None:
        """A worker (on ``device``) has the model's weights on its device (at start, after a move back, or in a
        lost worker's place, whose copy is counted again)."""
        name = model.name
        self._register(model)
        self.kept(model)
        self.failed.pop(name, None)
        if device is not None and self.known(name) and name not in self.moving:
            self.policy.worker_back(name, device)
        if self.policy.tier(name) in ("disk", "host") and name not in self.moving:
            self.policy.loading_started(name)
        if self.policy.tier(name) == "loading" and name not in self.moving:
            self.policy.loaded(name, time.monotonic())
            self.metrics.model_loads_total.labels(name).inc()

    def known(self, name: str) -> bool:
        return self.policy.has(name)

    def kept(self, model: Model) -> None:
        """Its workers' word on the host copies of its weights they keep (in answers to SLEEP and WAKE; issue 27)."""
        if self.known(model.name):
            self.policy.keeps(model.name, sum(w.host_kept for w in model.workers if w.state != WorkerState.DEAD))

    def admit(self, name: str, shape: Shape, outputs: int) -> TooLarge | None:
        """At admission: a job the model can never run within the budget is refused (``TooLarge``); so is
        every job of a model for which ``offload=auto`` found no configuration that fits (config.py)."""
        model = self.pool.models.get(name)
        if model is not None and model.config.nothing_fits:
            return self.nothing_fits(model)
        self.failed.pop(name, None)  # a failed load is tried again for a new job: its files may have been fixed
        if not self.known(name):
            return None
        plan = self.policy.plan(name, shape)
        if isinstance(plan, TooLarge):
            return dataclasses.replace(plan, reason=self._budget_said(plan))
        self.policy.queue(name, outputs)
        return None

    def _budget_said(self, plan: TooLarge) -> str:
        """A refusal's words, with where the budget it names came from (a flag, the GPU's size)."""
        device = plan.device or self.pool.models[plan.model].config.devices[0]
        return f"{plan.reason}. The budget on {device} is {self.budget_sources.get(device, 'unknown')}"

    def nothing_fits(self, model: Model) -> TooLarge:
        """Every job of a model for which ``offload=auto`` found no configuration that fits (config.py) is
        refused, and so is loading it by hand: the refusal names what was tried."""
        device = min(model.config.devices, key=lambda d: self.policy.budgets[d])  # the smallest, as config.py
        return TooLarge(model.name, 0, self.policy.budgets[device], (),
                        f"model {model.name!r} cannot run on {device}: {model.config.nothing_fits}", device=device)

    def unqueue(self, name: str, outputs: int) -> None:
        if self.known(name) and outputs:
            self.policy.unqueue(name, min(outputs, self.policy.queued(name)))
            self._pending_unloads()

    def batch_started(self, name: str, shape: Shape, device: str | None = None) -> None:
        if self.known(name):
            missing = shape.batch - self.policy.queued(name)
            if missing > 0:  # admitted before the model was known (resumed from the state dir, or at start)
                self.policy.queue(name, missing)
            try:
                self.policy.start(name, shape, time.monotonic(), jobs=shape.batch, device=device)
            except ResidencyError as exc:  # the books are off; the batch runs regardless, and it is said
                log.error("residency: %s", exc)

    def batch_finished(self, name: str, shape: Shape, keep_alive_s: float | None, device: str | None = None) -> None:
        if self.known(name):
            with contextlib.suppress(ResidencyError):  # a worker lost under it: worker_died settled the counts
                self.policy.finish(name, shape, time.monotonic(), jobs=shape.batch, keep_alive_s=keep_alive_s,
                                   device=device)
            self._pending_unloads()
            if self._held or self.turns.holds:
                # what it held may let a waiting model go, and nothing else would dispatch: the batch's
                # compute ended earlier, and a model waiting for memory would wait for the next job to come
                asyncio.get_running_loop().call_soon(self.on_change)

    def worker_lost(self, worker: WorkerLink, reason: str) -> None:
        """Only its own share leaves the books while other workers of its model serve on."""
        name = worker.config.model_name
        if self.known(name) and name not in self.moving:
            kept = self.policy.kept(name)
            self.policy.worker_died(name, worker.config.device, reason, kept=worker.host_kept)
            self.metrics.kept_released("worker_died", kept - self.policy.kept(name))

    def on_oom(self, name: str, shape: Shape, device: str) -> None:
        """A worker on ``device`` ran out of memory running ``shape`` and retries (worker/retry.py): the idle
        models there leave (``policy.on_oom``; not those on its model's other devices), so the retry's halves and
        the jobs after find room. The worker does not wait for them: a retry costs no round trip to the engine."""
        if not self.known(name):
            return
        decision = self.policy.on_oom(name, shape, 0, device=device)
        log.warning("%s: %s", name, decision.reason)
        if isinstance(decision, OomRetry):
            self._spawn_moves(decision.moves)

    # what the engine asks ---------------------------------------------------------------------------
    def review(self) -> None:
        """Before each dispatch: whose turn it is on each device (``turns.py``). Each hold that begins or ends
        is logged with its reason; a timer dispatches again when a waiting job will pass the bound."""
        now = time.monotonic()
        standing = self._standing()
        begun, ended = self.turns.review(standing, now)
        for e in ended:
            self._log_end(e)
        for hold in begun:
            log.info("%s is held: %s", hold.model, hold.reason)
        if self._turn_timer is not None:
            self._turn_timer.cancel()
            self._turn_timer = None
        when = self.turns.next_check(standing, now)
        if when is not None:
            self._turn_timer = asyncio.get_running_loop().call_later(when - now, self.on_change)

    def _standing(self) -> list[Standing]:
        return [Standing(s.name, s.device, s.residency, s.pinned, moving=s.name in self.moving,
                         running=s.running > 0, oldest=self.oldest(s.name),
                         blocked=self._held.get(s.name) == WAITING_FOR_MEMORY, devices=tuple(s.per_device),
                         short=self._short.get(s.name, ()))
                for s in self.policy.snapshot() if s.name in self.pool.models]

    @staticmethod
    def _log_end(e: Ended) -> None:
        log.info("%s takes batches again: %s", e.hold.model, e.reason)

    def may_dispatch(self, model: Model, shape: Shape | None) -> batches.Go | None:
        """May ``model`` take a batch of ``shape`` now (its oldest queued output's size, and as many outputs as the
        scheduler's next batch takes: ``Scheduler.forming``)? Go says how many outputs its batches may take now,
        answered with the yes itself so that no earlier answer's cap outlives it; None is not now, and the moves
        that will let it are started."""
        name = model.name
        if name in self.moving or name in self.failed:
            return None  # a move ends with a dispatch of its own; a failed load waits for a new job to ask
        if not self.known(name):
            if model.retired:  # on disk and never placed: its first load tells the policy its size
                self._start_learning(model)
                return None
            return batches.Go()  # not loaded yet at start: the pool's start brings it
        if name in self.preloading.models:  # loaded, or left on disk, by the preload in its turn: a load for a job
            return None  # beside it made the preload skip it and /ready say "done" while it loaded
        states = {w.state for w in model.workers}
        replaced = model.replacing or WorkerState.STARTING in states
        if not model.retired and replaced and (WorkerState.READY not in states or self.policy.tier(name) != "device"):
            return None  # a worker that died is being replaced by the pool: its READY dispatches
        if shape is not None:
            self._asked[name] = shape
        hold = self.turns.held(name)
        if hold is not None:
            self._yield(model, hold)
            return None
        first = None if shape is None else dataclasses.replace(shape, batch=1)
        plan: Plan | batches.Go = self.policy.plan(name, first)
        if isinstance(plan, Fits) and plan.load_from is None:  # its first output fits; the whole batch?
            plan = batches.room(self.policy, model, first, 1 if shape is None else shape.batch, self.moving)
        if isinstance(plan, batches.Go):
            self._held.pop(name, None)
            return plan
        if isinstance(plan, Fits) and plan.load_from is not None:
            self._begin_load(model, plan.load_from, plan.reason)
        elif isinstance(plan, Evict):
            self._spawn_moves(plan.moves)
        elif isinstance(plan, Wait):
            log.debug("%s waits: %s", name, plan.reason)
            self._held[name], self._short[name] = plan.stage, plan.short
            return None
        elif isinstance(weights := self.policy.plan(name, None), TooLarge):  # its load showed it larger than
            self.fail(name, weights.reason, ErrorCode.MODEL_TOO_LARGE, None)  # admission knew: no job would run
        elif isinstance(plan, TooLarge) and first is not None:  # this size, measured since, does not fit (issue 27)
            self.fail(name, f"this job's size no longer fits: its model's working memory, measured after the job "
                            f"was queued, makes it too large even with every other model evicted. "
                            f"{self._budget_said(plan)}", ErrorCode.MODEL_TOO_LARGE, first)
            asyncio.get_running_loop().call_soon(self.on_change)  # its jobs of other sizes are asked in turn
        self._held.pop(name, None)
        return None

    def _yield(self, model: Model, hold: Hold) -> None:
        leaving.yield_turn(self, model, hold)

    def why_waiting(self, name: str) -> str:
        """The stage a queued job of ``name`` shows while residency holds it back: the policy's own word
        when it said wait (a model off its device that waits for memory, not for its load), else by tier."""
        if name in self.turns.holds:
            return WAITING_FOR_TURN
        if name in self._held and name not in self.moving:
            return self._held[name]
        if name in self.moving or (self.known(name) and self.policy.tier(name) in ("host", "disk", "loading")):
            return LOADING
        return WAITING_FOR_MEMORY

    def load_progress(self, name: str, worker_id: int, nbytes: int) -> None:
        """A starting worker's LOAD_PROGRESS (after each component it read): its model's waiting jobs show it."""
        if (model := self.pool.models.get(name)) is not None:
            self.loads.record(model, worker_id, nbytes)
            self.on_change()  # the dispatch holds them again, with the new figure (``load_bytes``)

    def load_bytes(self, model: Model) -> tuple[int | None, int | None]:
        """What a job waiting for ``model``'s load waits for: (bytes loaded so far, total), both as
        ``load_reports.py`` counts them (an offloaded model reads far more than it keeps on the device)."""
        total = self.loads.total(model)
        return self.loads.so_far(model, total), total

    def snapshot(self) -> dict[str, ModelStatus]:
        """Each model's place; with a pending unload by hand, and a never-placed model whose load failed."""
        return byhand.snapshot(self)

    async def load(self, model: Model) -> None:
        await byhand.load(self, model)

    async def unload(self, model: Model, reason: str, *, later: bool = True) -> None:
        await byhand.unload(self, model, reason, later=later)

    def _pending_unloads(self) -> None:
        byhand.pending(self)

    async def sleep(self, model: Model, level: int, reason: str) -> None:
        await leaving.sleep(self, model, level, reason)

    # moves ------------------------------------------------------------------------------------------
    def _start(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._moves.add(task)
        task.add_done_callback(self._moves.discard)

    def _begin_load(self, model: Model, src: str, reason: str) -> None:
        """Book a load at once and carry it out in a task. Booked before the task first runs, because until
        then a second plan in the same dispatch (another model's, or this one's asked again) would see the
        same free memory and spend it twice."""
        name = model.name
        if name in self.moving:
            return
        try:
            self.policy.loading_started(name)
        except ResidencyError as exc:  # the books are off: said, and the dispatch goes on
            log.error("residency: %s", exc)
            return
        self.moving.add(name)
        log.info("loading %s from %s: %s", name, src, reason)
        self._start(self._load(model, src))

    async def _load(self, model: Model, src: str) -> None:
        name = model.name
        t0 = time.monotonic()
        try:
            if src == "host":  # one copy per tensor and one wait: 0 as it begins, the total once done (issue 27)
                self.loads.waking(model, 0)
                self.on_change()
                await self.pool.wake_model(model)
                self.kept(model)
                self.loads.waking(model, self.loads.total(model) or 0)
                self.on_change()  # still moving: its jobs show the total before they leave ``loading``
            else:
                await self.pool.revive(model)
        except Exception as exc:
            # the pool left no worker (``wake_model`` and ``revive`` are all or none): on disk, as the books now say
            log.log(logging.INFO if isinstance(exc, Asleep) else logging.ERROR, "loading %s failed: %s", name, exc)
            self.policy.load_failed(name, str(exc))
            for e in self.turns.release_for(name, f"{name} failed to load"):
                self._log_end(e)
            self.moving.discard(name)
            if not isinstance(exc, Asleep):  # a level-2 sleep stopped it: its jobs wait for the wake, which loads it
                ondemand.load_failed(self, model, str(exc))
        else:
            self.policy.loaded(name, time.monotonic())
            log.info("%s loaded from %s in %.0f ms", name, src, (time.monotonic() - t0) * 1000)
            self.metrics.model_loads_total.labels(name).inc()
            self.metrics.model_load_seconds.observe(time.monotonic() - t0)
            self.moving.discard(name)
        self.loads.waking(model, None)
        self._pending_unloads()
        self.on_change()

    async def learn(self, model: Model) -> str | None:
        """A model never seen and not preloaded has neither defaults nor a size: a request for it waits
        for its first load (the one its job would make anyway) and is completed with what the worker
        reports, rather than load every model once at start, which would take the memory an idle
        daemon should leave free. Returns why the load failed, or None; one load for all who wait. A model
        its files' headers already placed, too large for its budget, is not loaded: admission refuses it."""
        if self.known(model.name) and isinstance(self.policy.plan(model.name, None), TooLarge):
            return None
        return await asyncio.shield(self._start_learning(model))

    def _start_learning(self, model: Model) -> asyncio.Task[str | None]:
        return ondemand.start_learning(self, model)

    def _spawn_moves(self, moves: tuple[Move, ...]) -> None:
        """A decision's moves, left to run in a task (a dispatch does not wait for them), booked at once as a
        load is, and carried in their order: a copy into host memory only once the drops out of it that make
        its room are done, so host memory stays within ``--host-memory`` at every moment, not only in the books."""
        if moves:
            self._start(leaving.carry_booked(self, leaving.book(self, moves)))

    async def _carry(self, moves: tuple[Move, ...]) -> None:
        """A decision's moves, booked in the caller's step and carried in order, awaited (an unload by hand
        answers after); carried to their end when the caller is cancelled (a client that hung up): cut short, a
        move left its model booked as leaving while its workers were gone, and its jobs waited."""
        task = asyncio.ensure_future(leaving.carry_booked(self, leaving.book(self, moves)))
        self._moves.add(task)
        task.add_done_callback(self._moves.discard)
        await asyncio.shield(task)

    def _book(self, model: Model, move: Move) -> bool:
        name = model.name
        if name in self.moving:
            return False
        try:
            self.policy.unloading(move)
        except ResidencyError as exc:
            log.error("residency: %s", exc)
            return False
        self.moving.add(name)
        log.info("%s leaves %s for %s: %s", name, move.src, move.dst, move.reason)
        return True

    async def _expire_forever(self) -> None:
        await leaving.expire_forever(self, EXPIRY_CHECK_S)
