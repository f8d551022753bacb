"""Sleep and wake, carried out through residency, so its books say what the workers really hold.

A sleep is residency's own moves for every model, with reason ``sleep`` (the evictions metric counts
it): level 1 sends each model on a GPU where any move off the device goes (host memory, or disk past
``--host-memory``), level 2 sends every model to disk, also one residency had parked in host memory
or one a level-1 sleep left asleep, so that no worker process, CUDA context or host copy is left.
A model on a CPU device has nothing to free at level 1 (its memory is the host's): its workers are
paused in place and the answer says it stayed. A wake is the start's preload again: the models that
were on a device when the sleep began, then those the preload chooses, each as long as it fits beside
the ones before it (nothing is sent away for it); jobs that queued meanwhile are dispatched first.

The engine keeps the lock that orders sleeps and wakes and the drain; the pool keeps the level in
force, which decides what becomes of a worker that comes up while the daemon sleeps.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from diffusiond.daemon.config import DaemonConfig
from diffusiond.daemon.errors import PowerFailed
from diffusiond.daemon.residency.decisions import Fits, ModelStatus
from diffusiond.daemon.residency.keeper import Keeper
from diffusiond.daemon.residency.preload import choose
from diffusiond.daemon.workers.pool import Model, WorkerPool
from diffusiond.protocol import ErrorCode, WorkerState


class Engine(Protocol):
    """What of the engine (``engine.Engine``) these functions use, named here so that this module
    does not import the one that imports it."""

    config: DaemonConfig
    pool: WorkerPool
    keeper: Keeper
    _slept: list[Model]  # the models on a device when the sleep began: the wake brings them back first
    _socket_activated: bool  # the start's preload choice depends on it, and so does the wake's

    def models(self) -> list[Model]: ...
    def dispatch(self) -> None: ...
    def _busy(self) -> bool: ...
    async def _wait_until(self, done: Callable[[], bool], timeout: float) -> None: ...


log = logging.getLogger(__name__)

MOVES_POLL_S = 0.05


def on_cpu(model: Model) -> bool:
    return all(d.startswith("cpu") for d in model.config.devices)


def tier(engine: Engine, model: Model) -> str:
    """Where the model's weights are, as residency counts them (one never placed: disk or loading)."""
    if engine.keeper.known(model.name):
        return engine.keeper.policy.tier(model.name)
    return "disk" if model.retired or not model.workers else "loading"


async def locked(lock: asyncio.Lock, work: Awaitable[dict[str, Any]]) -> dict[str, Any]:
    async with lock:
        return await work


def unread(task: asyncio.Future[Any]) -> None:
    """A sleep whose caller left before it ended: its failure, which no answer carries, is logged."""
    if not task.cancelled() and task.exception() is not None:
        log.error("sleep failed after its caller left: %s", task.exception())


async def sleep(engine: Engine, level: int) -> dict[str, Any]:
    """Drain (running batches end, moves under way end), then every model off its device at ``level``
    (or the deeper level already in force). Answers the level in force and where each model is now."""
    pool, keeper = engine.pool, engine.keeper
    pool.paused = True  # no new dispatch, so no new load: what is under way ends, then the level applies
    deadline = time.monotonic() + engine.config.drain_grace_s
    await engine._wait_until(lambda: not engine._busy(), engine.config.drain_grace_s)
    while keeper.moving and time.monotonic() < deadline:  # a load begun for a job: it ends, then it leaves
        await asyncio.sleep(MOVES_POLL_S)
    # in force only now: set before the drain, level 2 would stop at its READY the very load the drain waits
    # for, and the load would count as failed (its jobs failed, the model refused until asked again)
    pool.sleep_level = level = max(pool.sleep_level, level)
    models = engine.models()
    engine._slept += [m for m in models if tier(engine, m) in ("device", "loading") and m not in engine._slept]
    reason = f"sleep (level {level})"

    async def one(model: Model) -> None:
        if level == 1 and on_cpu(model):
            await pool.sleep_model(model)  # paused in place: nothing to free, its memory is the host's
            keeper.kept(model)
        else:
            await keeper.sleep(model, level, reason)

    results = await asyncio.gather(*(one(m) for m in models), return_exceptions=True)
    # A move still under way past the drain's deadline (a load from host memory or disk a job began) would
    # leave its worker awake once it ends: the sleep waits for it (each move is bounded by the worker's own
    # timeout, worker_start_timeout_s), then the level applies to that model too (issue 27).
    late = [m for m in models if m.name in keeper.moving]
    if late:
        log.info("sleep waits for the moves of %s, under way past the drain", ", ".join(m.name for m in late))
        while any(m.name in keeper.moving for m in late):
            await asyncio.sleep(MOVES_POLL_S)
        results += await asyncio.gather(*(one(m) for m in late), return_exceptions=True)
    failed = [(m.name, e) for m, e in zip([*models, *late], results, strict=True) if isinstance(e, BaseException)]
    if failed:  # the level stays in force, so the answer says so: a 500 read as "still awake" left jobs waiting
        raise PowerFailed(f"sleep could not move {failed[0][0]} off its device: {failed[0][1]}; the daemon is asleep "
                          f"at level {level} all the same (nothing runs, jobs wait): sleep again to retry, or wake it "
                          "(`diffusiond wake`, POST /v1/admin/wake)", code=ErrorCode.SLEEP_FAILED)
    answer = placed(engine)
    status = keeper.snapshot()
    answer["stayed"] = {m.name: _why_stayed(m, level, status.get(m.name)) for m in models
                        if answer["models"][m.name]["residency"] in ("device", "loading")}
    if answer["stayed"]:
        log.info("asleep at level %d; on their devices still: %s", level,
                 "; ".join(f"{n} ({why})" for n, why in answer["stayed"].items()))
    return answer


def _why_stayed(model: Model, level: int, status: ModelStatus | None) -> str:
    """Why a model is on its device still after a sleep, for the sleep's answer (``stayed``)."""
    if level == 1 and on_cpu(model):
        return "its device is the CPU: paused in place, nothing to free (level 2 stops its workers)"
    if status is None:
        return "not placed yet"
    if status.running:
        return f"{status.running} output(s) still running when the drain ended (--drain-grace-s)"
    return status.reason


def placed(engine: Engine) -> dict[str, Any]:
    """The sleep's answer: the level in force and, per model, its tier and whether a worker process is up."""
    return {"level": engine.pool.sleep_level, "models": {
        m.name: {"residency": tier(engine, m), "device": m.config.devices[0],
                 "workers": sum(w.state in (WorkerState.READY, WorkerState.SLEEPING) for w in m.workers)}
        for m in engine.models()}}


async def wake(engine: Engine) -> None:
    """Workers paused in place wake, the queue is dispatched, then the preload runs again."""
    pool = engine.pool
    before, engine._slept = engine._slept, []
    pool.sleep_level = 0
    try:
        # asleep in place (a CPU model at level 1, or one that came up during a sleep): residency counts
        # it on its device, so a job would be sent to it; one residency parked in host memory stays there
        in_place = [m for m in engine.models() if tier(engine, m) in ("device", "loading")]
        await asyncio.gather(*(pool.wake_model(m) for m in in_place))
        for m in in_place:  # a GPU model that came up asleep in place keeps the host copy it slept into
            engine.keeper.kept(m)
    finally:
        pool.paused = False
        engine.dispatch()
    failed = [f for f in [await _load(engine, m) for m in _preload_order(engine, before)] if f]
    engine.dispatch()
    if failed:
        raise PowerFailed(f"wake could not load {failed[0]}", code=ErrorCode.WAKE_FAILED)


def _preload_order(engine: Engine, before: list[Model]) -> list[Model]:
    """The models on a device when the sleep began, then those the start's preload chooses, in order."""
    wanted = choose([(m.name, m.config.preload) for m in engine.models()], engine.config.preload,
                    engine._socket_activated)
    chosen = [m for m in engine.models() if wanted[m.name][0] and not m.config.nothing_fits]
    return list(dict.fromkeys([*before, *chosen]))


async def _load(engine: Engine, model: Model) -> str | None:
    """Onto its device if it fits now without sending another away (a preload's rule); why not, if it failed."""
    keeper = engine.keeper
    keeper.failed.pop(model.name, None)  # a wake asks explicitly, as a load by hand does: its files may be fixed
    if not keeper.known(model.name):
        failed = await keeper.learn(model) if model.retired else None
        if failed is not None or not keeper.known(model.name):
            return None if failed is None else f"{model.name}: {failed}"
    plan = keeper.policy.plan(model.name, None)
    if not isinstance(plan, Fits) or plan.load_from is None:
        if not isinstance(plan, Fits):
            log.info("%s stays off its device at wake: %s", model.name, plan.reason)
        return None
    keeper.may_dispatch(model, None)  # starts the load the plan said (booked, as for a job)
    while model.name in keeper.moving:
        await asyncio.sleep(MOVES_POLL_S)
    if keeper.policy.tier(model.name) != "device":
        return f"{model.name}: {keeper.snapshot()[model.name].reason}"
    return None
