"""The worker pool: which workers exist, and keeping them alive (the engine's arbiter).

The engine decides what work goes where; the pool decides which workers there are. It spawns
one worker per (model, device), pings them, replaces one that ended (after a back-off that grows
while workers keep dying young, so a crash loop cannot spin), moves one model's workers for
residency (sleep, wake, retire, revive), and fans trace and stop out to all of them. While the
daemon sleeps (``sleep_level``) a worker that comes up joins it: asleep at level 1, stopped at 2.
Frames and losses go straight to the engine's callbacks: the pool never looks inside a job.

The engine reaches a worker only through ``link.WorkerLink``, so tests can give the pool a
``spawn`` that makes in-process fakes and drive every transition of the engine without a process.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import diffusiond.daemon.workers.template as templates
from diffusiond.daemon.config import DaemonConfig, ModelConfig, compile_cache_dir
from diffusiond.daemon.errors import ModelNotFound, PowerFailed, WorkerUnavailable
from diffusiond.daemon.metrics import Metrics
from diffusiond.daemon.workers.handle import WorkerHandle
from diffusiond.daemon.workers.link import FrameCallback, LostCallback, WorkerLink, WorkerStartError
from diffusiond.ipc.messages import Ack, Capabilities, Release, Sleep, Trace, Wake, WarmupShape, WorkerConfig
from diffusiond.protocol import ErrorCode, ModelState, WorkerState

log = logging.getLogger(__name__)

PING_INTERVAL_S = 1.0
# A worker's own stop, SHUTDOWN answered and the process gone, before SIGKILL: apart from the drain grace, which
# has already been waited by the time the daemon stops its workers, and which a worker inside a long forward (it
# answers nothing until the forward ends) made the stop wait twice, past the unit's TimeoutStopSec.
WORKER_STOP_S = 10.0
# Starts of a lost worker's replacement that may fail in a row before the pool stops trying: one that fails this
# often fails for a reason a retry does not change (its files, its device), and the model's jobs must hear it.
REPLACE_ATTEMPTS = 5


Spawn = Callable[[WorkerConfig, dict[str, str], FrameCallback, LostCallback], WorkerLink]
Prepare = Callable[["Model", WorkerLink], Awaitable[bool]]  # True: the worker exits (it failed during it)
# a lost worker's replacement did not start: the model, why, and whether the pool gave up (the model is on disk)
Unreplaced = Callable[["Model", str, bool], None]


def spawn_process(config: WorkerConfig, env: dict[str, str], on_frame: FrameCallback,
                  on_lost: LostCallback, template: templates.Template | None = None) -> WorkerLink:
    return WorkerHandle(config, on_frame=on_frame, on_lost=on_lost, env=env, template=template)


@dataclass(eq=False)
class Model:
    config: ModelConfig
    workers: list[WorkerLink] = field(default_factory=list)
    capabilities: Capabilities = field(default_factory=Capabilities)  # generic until the first READY
    known: bool = False  # ``capabilities`` are the model's own (a READY, or remembered from the last run)
    restarts: int = 0
    crash_streak: int = 0  # consecutive workers that died within a minute of starting
    replacing: int = 0  # replacements under way: jobs are still accepted and wait for them
    lora_errors: dict[str, str] = field(default_factory=dict)  # LoRA name -> why it does not fit this model
    controlnet_errors: dict[str, str] = field(default_factory=dict)  # ControlNet name -> why it does not fit
    ip_adapter_errors: dict[str, str] = field(default_factory=dict)  # IP-Adapter name -> why it does not fit
    retired: bool = False  # residency stopped its workers (weights back on disk); a job starts them again

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def task(self) -> str:
        return self.capabilities.task

    @property
    def state(self) -> ModelState:
        states = {w.state for w in self.workers}
        for best in (WorkerState.READY, WorkerState.SLEEPING, WorkerState.STARTING):
            if best in states:
                return ModelState(best.value)
        # residency stopped its workers, or never started them: not a fault, a job loads it; a
        # failed load is retired too, and shown ``unavailable`` by the listing, which knows (``views.model_state``)
        return ModelState.UNLOADED if self.retired else ModelState.UNAVAILABLE

    def can_take_jobs(self) -> bool:
        """A worker is up, starting or on its way back: a job admitted now will be run."""
        return self.retired or self.state != ModelState.UNAVAILABLE or self.replacing > 0 or any(
            w.state == WorkerState.STARTING for w in self.workers)


_ASLEEP = ("{} was not started: the daemon sleeps at level 2 (everything freed); wake it first "
           "(diffusiond wake, POST /v1/admin/wake)")


class Asleep(WorkerStartError):
    """A worker was stopped as it came up, because the daemon sleeps at level 2."""


class WorkerPool:
    def __init__(self, config: DaemonConfig, metrics: Metrics, *, on_frame: FrameCallback,
                 on_lost: LostCallback, on_ready: Callable[[WorkerLink], None],
                 spawn: Spawn = spawn_process, prepare: Prepare | None = None,
                 on_unreplaced: Unreplaced = lambda model, why, gave_up: None) -> None:
        self.config = config
        self.metrics = metrics
        self.models = {m.name: Model(m) for m in config.models}
        self.paused = False  # sleeping or on the way there: nothing is dispatched
        # the sleep level in force (0: awake): a worker that comes up under level 1 sleeps at once, one
        # under level 2 is stopped (``_start_worker``), so a trainer told "everything freed" gets it
        self.sleep_level = 0
        # workers stopped on purpose or lost whose arena the engine still maps, for outputs it still
        # holds (the arena is unmapped with the last one: ``WorkerHandle.return_slot``); counted in /health
        self._departed: list[WorkerLink] = []
        self.stopping = False
        self._on_frame = on_frame
        self._on_lost = on_lost
        self._on_ready = on_ready
        self._on_unreplaced = on_unreplaced
        # each worker gone (stopped on purpose, or lost): what the engine kept for it goes. Set by ``Flights``, not
        # passed in as ``on_unreplaced`` is: Flights is built from the pool, so it cannot exist before it
        self.on_departed: Callable[[list[WorkerLink]], None] = lambda workers: None
        self._ready_at: dict[WorkerLink, float] = {}  # each live worker's READY: its life, for the crash streak
        # the worker template ``diffusiond serve`` started (workers/template.py), for real processes only
        self.template = templates.claim() if spawn is spawn_process else None
        self._spawn = spawn if self.template is None else functools.partial(spawn_process, template=self.template)
        # what a started worker must get before its first batch (the live weight updates it missed);
        # while it runs the worker is in ``preparing`` and takes no batch (Flights.dispatch)
        self._prepare = prepare
        self.preparing: set[WorkerLink] = set()
        self._worker_ids = 0
        self.lora_paths: dict[str, str] = dict(config.loras)  # what each new worker loads (runtime ones too)
        self.lora_target_rank = 0  # the engine sets it: the largest rank registered at start (compiled models)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._beating = False
        for name in self.models:  # export restarts 0 from the start: a missing series is not a zero
            self.metrics.worker_restarts.labels(name)

    def model(self, name: str | None) -> Model:
        if name is None:
            return next(iter(self.models.values()))
        try:
            return self.models[name]
        except KeyError:
            raise ModelNotFound(f"model {name!r} is not served here; models: {', '.join(self.models)}",
                                field="model") from None

    def workers(self, *states: WorkerState) -> Iterator[tuple[Model, WorkerLink]]:
        for model in self.models.values():
            for w in model.workers:
                if not states or w.state in states:
                    yield model, w

    # lifecycle ------------------------------------------------------------------------------
    async def start(self, models: list[Model] | None = None) -> None:
        """Start the workers of ``models`` (all, by default) side by side; fail with the first worker's
        reason if a model cannot load. The heartbeat starts with the first call."""
        starts = [self._start_worker(model, device) for model in (self.models.values() if models is None else models)
                  for device in model.config.devices]
        results = await asyncio.gather(*starts, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]
        if not self._beating:
            self._beating = True
            self._keep(self._heartbeat())

    async def stop(self) -> None:
        self.stopping = True
        await asyncio.gather(*(w.stop(WORKER_STOP_S) for _, w in self.workers()),
                             return_exceptions=True)
        for t in list(self._tasks):
            t.cancel()
        if self.template is not None:
            await self.template.close()

    def _keep(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _heartbeat(self) -> None:
        """Ping every worker each second: a lost frame shows up as a sequence gap within a second,
        and /health can tell a live worker from a wedged one."""
        while not self.stopping:
            await asyncio.sleep(PING_INTERVAL_S)
            for _, w in self.workers():
                with contextlib.suppress(Exception):
                    w.ping()

    def _worker_config(self, model: Model, device: str, *, replacement: bool) -> WorkerConfig:
        self._worker_ids += 1
        return WorkerConfig(
            worker_id=self._worker_ids - 1,
            model_name=model.name,
            model_spec=model.config.spec,
            device=device,
            dtype=model.config.dtype,
            output_mode=self.config.output_mode,
            arena_bytes=self.config.arena_mb << 20,
            slot_timeout_s=self.config.slot_timeout_s,
            drain_timeout_s=self.config.drain_grace_s,
            options=self._options(model),
            compile=model.config.compile,
            warmup=[WarmupShape(w, h, b) for w, h, b in model.config.warmup],
            compile_cache_dir=str(compile_cache_dir(self.config.state_path)) if model.config.compile else "",
            trace_gpu=self.config.trace,
            fault="" if replacement else self.config.fault,  # test faults hit first workers only
            loras=dict(self.lora_paths),
            max_loras=self.config.max_loras,
            lora_target_rank=self.lora_target_rank,
            controlnets={name: c.path for name, c in self.config.controlnets.items()},
            ip_adapters=dict(self.config.ip_adapters),
            upscalers=dict(self.config.upscalers),
        )

    def _options(self, model: Model) -> dict[str, str]:
        """The model's options, with the daemon-wide preview decoder unless the model names its own."""
        decoder = self.config.preview_decoder
        extra = {"preview_decoder": str(Path(decoder).expanduser())} if decoder else {}
        return {**extra, **model.config.options}

    def _env(self, device: str) -> dict[str, str]:
        """The log level, read before INIT arrives. CPU workers share the cores: each gets its
        share of math threads, so N workers do not run N x cores threads (oversubscribed BLAS
        can be ten times slower, not N times)."""
        env = {"DIFFUSIOND_LOG_LEVEL": self.config.log_level.upper()}
        if device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            cpu_workers = sum(m.config.devices.count("cpu") for m in self.models.values())
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // max(1, cpu_workers)))
        return env

    async def _start_worker(self, model: Model, device: str, replacing: WorkerLink | None = None) -> None:
        if self.sleep_level >= 2:
            raise Asleep(_ASLEEP.format(model.name))
        wc = self._worker_config(model, device, replacement=replacing is not None)
        handle = self._spawn(wc, self._env(device), self._on_frame, self._lost)
        if replacing is not None and replacing in model.workers:
            model.workers[model.workers.index(replacing)] = handle
        else:
            model.workers.append(handle)
        try:
            ready = await handle.start(self.config.worker_start_timeout_s)
        except BaseException:
            self._unplace(model, handle, replacing)
            raise
        self._ready_at[handle] = time.monotonic()
        model.capabilities = ready.capabilities
        model.controlnet_errors = dict(ready.controlnet_errors)
        model.ip_adapter_errors = dict(ready.ip_adapter_errors)
        model.known = True
        for name in self.lora_paths:  # each worker loaded every adapter: the latest one's word stands
            if name in ready.lora_errors:
                model.lora_errors[name] = ready.lora_errors[name]
            else:
                model.lora_errors.pop(name, None)
        if self._prepare is not None:
            self.preparing.add(handle)
            try:
                exits = await self._prepare(model, handle)
            finally:
                self.preparing.discard(handle)
            # it failed half-way through a live update and exits: announced ready, a loss the engine has already
            # handled would put it back among the workers batches go to; its loss replaces it
            if exits:
                return
        if self.sleep_level >= 2:
            await self._stop_asleep(model, handle)
        if self.paused:
            await self._join_sleep(model, handle, replacing)
        self._on_ready(handle)

    @staticmethod
    def _unplace(model: Model, handle: WorkerLink, replacing: WorkerLink | None) -> None:
        """Put things back as they were before a start that failed: the caller decides whether to try again; a
        retire meanwhile (which stopped it) already took it out, and a ValueError here would hide why it failed."""
        if handle in model.workers and replacing is not None:
            model.workers[model.workers.index(handle)] = replacing
        elif handle in model.workers:
            model.workers.remove(handle)

    async def _join_sleep(self, model: Model, handle: WorkerLink, replacing: WorkerLink | None) -> None:
        """A worker that came up while the daemon sleeps at level 1 sleeps too, given as long as a model's sleep
        (``_move``). One that does not is stopped, as a half-moved model's are: left awake, it would hold the device
        the sleep promised free, with no batch sent to it until the wake."""
        timeout = self.config.worker_start_timeout_s
        try:
            answer: Ack | BaseException = await handle.command(Sleep(), timeout)
        except Exception as exc:
            answer = exc
        bad = failures([handle], [answer], timeout)
        if not bad:
            return
        self._unplace(model, handle, replacing)
        self._depart([handle])
        await handle.stop(WORKER_STOP_S)
        raise WorkerStartError(f"it came up while the daemon sleeps at level 1 and did not go to sleep: {bad[0]}")

    async def _stop_asleep(self, model: Model, handle: WorkerLink) -> None:
        """A worker that came up while the daemon sleeps at level 2 (an on-demand load, a replacement, a
        start begun before the sleep) is stopped, not slept at level 1: level 2 promised the whole card."""
        self._unplace(model, handle, None)
        model.retired = not model.workers
        self._depart([handle])
        await handle.stop(WORKER_STOP_S)
        raise Asleep(_ASLEEP.format(model.name))

    # losing and replacing workers ------------------------------------------------------------
    def _lost(self, worker: WorkerLink, reason: str) -> None:
        """A worker ended: the engine fails what it held, then it is replaced (unless stopping)."""
        log.error("%s", reason)
        model = self.models[worker.config.model_name]
        # died within a minute of its READY, not of its spawn: a model whose load takes a minute never grew it
        died_young = time.monotonic() - self._ready_at.get(worker, time.monotonic()) < 60
        self._depart([worker])
        self._on_lost(worker, reason)
        if self.stopping:
            return
        model.crash_streak = model.crash_streak + 1 if died_young else 0
        model.restarts += 1
        self.metrics.worker_restarts.labels(model.name).inc()
        model.replacing += 1  # now, not when the task starts: admission must see it at once
        self._keep(self._restart(model, worker))

    async def _restart(self, model: Model, old: WorkerLink) -> None:
        backoff = self.config.restart_backoff_s
        attempt = model.crash_streak
        device = old.config.device
        try:
            for tries in range(1, REPLACE_ATTEMPTS + 1):
                await asyncio.sleep(backoff[min(attempt, len(backoff) - 1)])
                if self.stopping or old not in model.workers:  # residency stopped the model's workers meanwhile
                    return  # (``retire``): ``revive`` starts them all again, and one more here would be one too many
                try:
                    await self._start_worker(model, device, replacing=old)
                    log.info("replaced %s", old.name)
                    return
                except Asleep:  # not replaced while everything is freed: the wake, or a job after it, loads it
                    self._give_up(model, old)
                    return
                except Exception as exc:  # whatever it was, the model must not be left waiting for a start that died
                    if self.stopping or old not in model.workers:  # stopped on purpose mid-start (a level-2 sleep,
                        return  # an unload): no failed try, and its jobs wait for the wake or the load, not fail
                    why = f"{type(exc).__name__}: {exc}" if not isinstance(exc, WorkerStartError) else str(exc)
                    attempt += 1
                    if tries == REPLACE_ATTEMPTS:
                        log.error("replacing %s's worker on %s failed %d times in a row; it is not tried again until "
                                  "a job loads the model: %s", model.name, device, tries, why)
                        self._give_up(model, old)
                    else:
                        log.error("replacing %s's worker on %s failed (try %d of %d): %s", model.name, device, tries,
                                  REPLACE_ATTEMPTS, why)
                    self._on_unreplaced(model, f"its worker on {device} was lost, and its replacement did not "
                                               f"start ({tries} of {REPLACE_ATTEMPTS} tries): {why}",
                                        tries == REPLACE_ATTEMPTS)
        finally:
            model.replacing -= 1

    @staticmethod
    def _give_up(model: Model, old: WorkerLink) -> None:
        """The lost worker is not replaced: the model is on disk until a load starts it (``revive``)."""
        if old in model.workers:
            model.workers.remove(old)
        model.retired = not model.workers

    # one model's workers, for residency (daemon/residency/keeper.py) ------------------------------
    async def sleep_model(self, model: Model) -> None:
        """Its weights leave the device for its workers' host memory (they stay up, so waking is a copy). All or
        none: a worker that refuses puts its weights back (worker/control_items.py), so where none moved the model
        is on its devices as before; where some did and another did not, all of them stop (``_stop_half_moved``).
        A worker that did not answer in time counts as one that may have moved: its SLEEP stays queued there and
        can still run."""
        await self._move(model, Sleep(), WorkerState.READY, WorkerState.SLEEPING, ErrorCode.SLEEP_FAILED)

    async def wake_model(self, model: Model) -> None:
        """Its weights back onto the device from its workers' host memory. All or none: a worker whose WAKE failed
        does not undo it (part of its weights may be on the device), so any failure stops them all."""
        await self._move(model, Wake(), WorkerState.SLEEPING, WorkerState.READY, ErrorCode.WAKE_FAILED)

    async def release_host(self, model: Model) -> None:
        """Its awake workers free the host copies of its weights they keep (issue 27); each answers what it keeps."""
        targets = [w for w in model.workers if w.state == WorkerState.READY]
        timeout = self.config.worker_start_timeout_s
        acks = await asyncio.gather(*(w.command(Release([], host_copy=True), timeout) for w in targets),
                                    return_exceptions=True)
        bad = failures(targets, acks, timeout)
        if bad:
            raise WorkerUnavailable(f"{len(bad)} worker(s) of {model.name} did not free their host copy: {bad[0]}")

    async def retire(self, model: Model) -> None:
        """Stop the model's workers on purpose (not a loss: nothing is replaced); ``revive`` starts them."""
        model.retired = True
        workers, model.workers = list(model.workers), []
        self._depart(workers)
        await asyncio.gather(*(w.stop(WORKER_STOP_S) for w in workers), return_exceptions=True)

    async def revive(self, model: Model) -> None:
        """Start a worker on each of its devices that has none: one that lives, or one lost that the pool is
        replacing (it keeps its place in ``workers`` until then), is not doubled. All or none: it
        ends once every start it began has, and if one failed, the workers that came up are stopped and the error
        of several starts names the failed one's device (a worker's FATAL does not). Ending at the first failure
        left the other starts running behind the caller's clean-up, which stopped them mid-start."""
        missing = list(model.config.devices)
        for w in model.workers:
            if w.config.device in missing:
                missing.remove(w.config.device)
        before = list(model.workers)
        try:
            results = await asyncio.gather(*(self._start_worker(model, d) for d in missing), return_exceptions=True)
            failed = [(d, r) for d, r in zip(missing, results, strict=True) if isinstance(r, BaseException)]
            if not failed:
                return
            came_up = [w for w in model.workers if w not in before]
            model.workers = [w for w in model.workers if w not in came_up]
            self._depart(came_up)
            await asyncio.gather(*(w.stop(WORKER_STOP_S) for w in came_up), return_exceptions=True)
        finally:
            model.retired = not model.workers
        device, exc = next(((d, e) for d, e in failed if not isinstance(e, Asleep)), failed[0])
        if isinstance(exc, Asleep) or not isinstance(exc, Exception) or len(missing) == 1:
            raise exc
        stopped = f" (stopped the one(s) that came up on {', '.join(w.config.device for w in came_up)})" \
            if came_up else ""
        raise WorkerStartError(f"its worker on {device} did not start: {exc}{stopped}") from exc

    async def _move(self, model: Model, msg: Sleep | Wake, src: WorkerState, dst: WorkerState,
                    code: ErrorCode) -> None:
        targets = [w for w in model.workers if w.state == src]
        timeout = self.config.worker_start_timeout_s
        acks = await asyncio.gather(*(w.command(msg, timeout) for w in targets), return_exceptions=True)
        bad = failures(targets, acks, timeout)
        if not bad:
            return
        error = f"{'sleep' if isinstance(msg, Sleep) else 'wake'} failed on {len(bad)} worker(s): {bad[0]}"
        if isinstance(msg, Sleep) and not any(w.state == dst or isinstance(a, TimeoutError)
                                              for w, a in zip(targets, acks, strict=True)):
            raise PowerFailed(error, code=code)
        stopped = await self._stop_half_moved(model, error)
        raise PowerFailed(f"{error}; so that none is left half moved, {model.name}'s {stopped} worker(s) were "
                          f"stopped: it is on disk now, and its next job loads it anew", code=code)

    async def _stop_half_moved(self, model: Model, error: str) -> int:
        """Stop every worker of a model whose move some of them made and another did not: a worker left asleep is
        never woken (batches go to awake ones) and its host copy goes uncounted. Each is told to the engine as lost:
        residency, whose own move it was, books the model on disk itself (it lets a moving model's losses pass), but
        the daemon's sleep and wake, which pause a CPU model in place, book nothing, and without the loss the books
        would keep the model on its devices with no worker to send its jobs to. A job a worker held ends with the
        reason. Returns how many there were."""
        live = [w for w in model.workers if w.state != WorkerState.DEAD]  # a dead one was told already
        await self.retire(model)
        for w in live:
            self._on_lost(w, f"{w.name} was stopped: {error}")
        return len(live)

    def _depart(self, workers: list[WorkerLink]) -> None:
        self._departed = [w for w in self._departed if w.arena_capacity] + workers  # the unmapped ones go
        for w in workers:
            self._ready_at.pop(w, None)
        self.on_departed(workers)

    def departed_arenas(self) -> list[WorkerLink]:
        """Workers gone (stopped or lost) whose arena is still mapped for outputs the engine holds."""
        self._departed = [w for w in self._departed if w.arena_capacity]
        return list(self._departed)

    async def trace(self) -> list[tuple[WorkerLink, Ack]]:
        """Each ready worker's timeline (``--trace``)."""
        handles = [w for _, w in self.workers(WorkerState.READY)]
        acks = await asyncio.gather(*(w.command(Trace(), 30.0) for w in handles), return_exceptions=True)
        out = []
        for w, ack in zip(handles, acks, strict=True):
            if isinstance(ack, BaseException):
                raise WorkerUnavailable(f"{w.name} did not send its trace: {ack}")
            out.append((w, ack))
        return out


def failures(workers: list[WorkerLink], answers: list[Ack | BaseException], timeout: float) -> list[str]:
    """Each worker whose command failed, with its own reason: an answer's message, not the whole ACK's repr, and a
    timeout named as one (its text is empty), for the error a client reads."""
    out = []
    for w, a in zip(workers, answers, strict=True):
        if isinstance(a, TimeoutError):
            out.append(f"{w.name} did not answer within {timeout:g}s")
        elif isinstance(a, BaseException) or not a.ok:
            out.append(f"{w.name}: {a if isinstance(a, BaseException) else a.message or 'failed, saying nothing'}")
    return out
