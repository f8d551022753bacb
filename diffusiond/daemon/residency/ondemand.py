"""Load on demand, carried out for the keeper: what the start loads, and a never-seen model's first load.

``preload.py`` decides which models the start loads; ``preload`` here loads them, in the order configured
and within the budget, and leaves every other model on disk with no worker (``on_disk``). A model never
seen has no size and no defaults until it has loaded once, so its first request waits for that load
(``start_learning``; one load for everyone who asks) and is then checked with what the worker reported.
Functions of the keeper (``keeper.py`` keeps a one-line method for each), split off it so that each of
the two modules has one job: the keeper the moves of a running daemon, this module the loads that make
a model known, and what a load that fails does (``load_failed``).

A load that fails (corrupt files, a spec that no longer loads) fails the jobs waiting for it at once, with
the worker's reason (``model_load_failed``), and nothing loads the model again by itself: a failed load
tried again at each dispatch would start a worker every few seconds, for ever, and the jobs would wait
until their deadline for a load that fails the same way. The next job for it (``Keeper.admit``), or a load
by hand, tries once more: its files may have been fixed meanwhile. The start is best effort in the same
way: a model that fails to load there stays on disk with the reason, and the others serve.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from diffusiond.daemon.config import DaemonConfig
from diffusiond.daemon.metrics import Metrics
from diffusiond.daemon.residency.budget import NO_BUDGET
from diffusiond.daemon.residency.decisions import Evict, Fits, Move, Release, TooLarge
from diffusiond.daemon.residency.policy import Residency
from diffusiond.daemon.residency.preload import Preloading, choose
from diffusiond.daemon.residency.working import Shape
from diffusiond.daemon.workers.pool import Asleep, Model, WorkerPool
from diffusiond.protocol import ErrorCode


class Keeper(Protocol):
    """What these functions need of ``keeper.Keeper`` (named here so the two modules do not import each other)."""

    config: DaemonConfig
    pool: WorkerPool
    policy: Residency
    metrics: Metrics
    moving: set[str]
    on_change: Callable[[], None]
    fail: Callable[[str, str, ErrorCode, Shape | None], None]
    failed: dict[str, str]
    preloading: Preloading
    _learning: dict[str, asyncio.Task[str | None]]

    def _register(self, model: Model) -> None: ...
    def worker_ready(self, model: Model) -> None: ...
    def _carry(self, moves: tuple[Move, ...]) -> Coroutine[Any, Any, None]: ...
    def _spawn_moves(self, moves: tuple[Move, ...]) -> None: ...

log = logging.getLogger("diffusiond.daemon.residency.keeper")  # one logger for residency's moves


class LoadFailed(RuntimeError):
    """A load by hand (``Keeper.load``) failed: the message is the worker's reason."""


def load_failed(k: Keeper, model: Model, reason: str) -> None:
    """``model`` could not be loaded: the jobs waiting for it fail with ``reason``, and it stays on disk until
    a new job or a load by hand asks again (``Keeper.failed``; see the module's docstring)."""
    name = model.name
    k.failed[name] = reason
    k.fail(name, f"model {name!r} could not be loaded: {reason}. The next job for it tries the load again "
                 "(fix its files or its spec first)", ErrorCode.MODEL_LOAD_FAILED, None)


def choose_preload(k: Keeper, socket_activated: bool = False) -> list[Model]:
    """The models the configuration chooses to load at start (``preload.py``), in the order configured; every
    other one is placed on disk now, with no worker, until a job needs it. Decided before jobs are admitted,
    so ``/ready`` and systemd's STATUS can name what the preload (which runs after) is loading."""
    models = list(k.pool.models.values())
    wanted = choose([(m.name, m.config.preload) for m in models], k.config.preload, socket_activated)
    for model in models:
        want, why = wanted[model.name]
        if want and model.config.nothing_fits:
            want, why = False, model.config.nothing_fits
            wanted[model.name] = (want, why)
        log.info("%s %s at start: %s", model.name, "loads" if want else "stays on disk", why)
        if not want:
            on_disk(k, model)
        elif not model.known or model.capabilities.weight_bytes:
            # placed on disk now, its size remembered or from its files' headers, as one not chosen is: a job
            # sent before the preload reaches it is checked at admission as it would be after (a model too
            # large is a 400, not a job left queued for a load the preload then declines)
            k._register(model)
    chosen = [m for m in models if wanted[m.name][0]]
    k.preloading.begin([m.name for m in chosen])
    return chosen


async def preload(k: Keeper, chosen: list[Model]) -> None:
    """Load ``chosen`` (``choose_preload``). Without a budget side by side. With one, in the order configured:
    a model that ran before (its size remembered in the state dir) and does not fit beside those loaded
    already is not loaded at all, nor is one whose files' headers show it larger than the budget; one never
    seen is loaded once, to learn its capabilities and size, and leaves again at once if it does not fit.
    Jobs are admitted meanwhile: each model's READY dispatches the jobs waiting for it."""
    try:
        await _preload(k, chosen)
    finally:
        k.preloading.done()


async def _preload(k: Keeper, chosen: list[Model]) -> None:
    await k.pool.start([])  # the heartbeat, whatever loads
    if all(b >= NO_BUDGET for b in k.policy.budgets.values()):  # no device's memory could be read
        got = await asyncio.gather(*(_start_one(k, m) for m in chosen), return_exceptions=True)
        await _best_effort(k, list(zip(chosen, got, strict=True)))
        return
    tried: list[tuple[Model, BaseException | None]] = []
    for model in chosen:
        if k.pool.paused:  # a sleep began: the wake loads what the start chose, in the same order
            on_disk(k, model)
            k.preloading.ended(model.name)
            log.info("%s stays on disk at start: the daemon sleeps (the wake loads it)", model.name)
            continue
        if not model.known or model.capabilities.weight_bytes:
            k._register(model)  # its remembered size, or its files' headers' (a hub id: neither, it learns)
        first = k.policy.plan(model.name, None) if k.policy.has(model.name) else None
        if isinstance(first, Evict) and all(m.src == "host" or isinstance(m, Release) for m in first.moves):
            # room in host memory for what it keeps there (offloaded), made as any load from disk makes it: the
            # preload sends no model off its device, but one parked in host memory (by a keep-alive that ended, an
            # unload) goes to disk for it, rather than the model stay on disk
            await k._carry(first.moves)
            first = k.policy.plan(model.name, None)
        # one never seen that fits alone still loads once, to learn its defaults (its requests need them)
        if first is not None and not isinstance(first, Fits) and (model.known or isinstance(first, TooLarge)):
            model.retired = True
            k.preloading.ended(model.name)
            log.info("%s stays on disk at start: %s", model.name, first.reason)
            continue
        # counted on its device from now, not from its READY: a job's load meanwhile plans around it
        counted = k.policy.has(model.name) and k.policy.tier(model.name) in ("disk", "host")
        if counted:
            k.policy.loading_started(model.name)
        try:
            await _start_one(k, model)
        except Exception as exc:
            if counted and k.policy.tier(model.name) == "loading":
                k.policy.load_failed(model.name, str(exc))
            tried.append((model, exc))
            continue
        tried.append((model, None))
        plan = k.policy.plan(model.name, None)
        over = any(k.policy.device_used(d) > k.policy.budgets[d] for d in model.config.devices)
        if over or isinstance(plan, TooLarge):
            move = Move(model.name, "device", "disk", "preload: it does not fit beside the models before it")
            await k._carry((move,))
    await _best_effort(k, tried)


async def _start_one(k: Keeper, model: Model) -> None:
    """One model's load at start, a move like any other (``moving``) while it runs: a sleep begun meanwhile
    waits for it, then sends it where the level says, so the books agree with the workers (issue 27)."""
    k.moving.add(model.name)
    try:
        await k.pool.start([model])
    finally:
        k.moving.discard(model.name)
        k.preloading.ended(model.name)
    k.worker_ready(model)  # booked on its device now that it is no longer moving (its READY was not)
    k.on_change()  # its jobs, which its READY could not dispatch while it moved


async def _best_effort(k: Keeper, tried: list[tuple[Model, BaseException | None]]) -> None:
    """A model that failed to load at start stays on disk with the reason, and the others serve. Only when
    every model the start tried failed does the start fail, with the first one's reason: a daemon that
    could load none of what it was told to is misconfigured, which is said at once rather than by each job.
    A model on several devices may have failed on one only: the workers that came up on the others are
    stopped (and the books, which their READY put on the device, moved to disk), so none holds memory
    for a model that cannot serve."""
    for _, exc in tried:
        if exc is not None and not isinstance(exc, Exception):
            raise exc  # cancelled: the start itself is stopping
    # a level-2 sleep stopped it (``Asleep``): not loaded, not failed; it stays on disk and its jobs wait for
    # the wake, which loads it (issue 27), so it counts neither as a failure nor as a model the start tried
    for model, exc in tried:
        if isinstance(exc, Asleep):
            log.info("%s stays on disk: %s", model.name, exc)
            on_disk(k, model)
    tried = [(m, e) for m, e in tried if not isinstance(e, Asleep)]
    failures = [(m, e) for m, e in tried if e is not None]
    if failures and len(failures) == len(tried):
        raise failures[0][1]
    for model, exc in failures:
        reason = str(exc)
        log.error("%s stays on disk: loading it at start failed: %s", model.name, reason)
        if k.policy.has(model.name) and k.policy.tier(model.name) == "device":
            await k._carry((Move(model.name, "device", "disk", f"it failed to load on another device: {reason}"),))
        elif model.workers:
            await k.pool.retire(model)
        on_disk(k, model)
        if k.policy.has(model.name) and k.policy.tier(model.name) in ("host", "disk"):  # the books say why
            k.policy.loading_started(model.name)
            k.policy.load_failed(model.name, reason)
        load_failed(k, model, reason)


def on_disk(k: Keeper, model: Model) -> None:
    """Not loaded at start: no worker (``retired``: a job starts them); placed in the budget now when
    its size is remembered or its files' headers give it, else by its first load (``learn``)."""
    model.retired = True
    if not model.known or model.capabilities.weight_bytes:
        k._register(model)


def start_learning(k: Keeper, model: Model) -> asyncio.Task[str | None]:
    task = k._learning.get(model.name)
    if task is None:
        task = k._learning[model.name] = asyncio.ensure_future(_learn(k, model))
        task.add_done_callback(lambda _: k._learning.pop(model.name, None))
    return task

async def _learn(k: Keeper, model: Model) -> str | None:
    """Its first load. Nothing is dispatched to it (``moving``) until the size it reports is placed:
    it stays if it fits; idle models leave if that makes room (as they would for its job); else it
    leaves at once, as at start, and its jobs wait to load it again once there is room."""
    name = model.name
    k.moving.add(name)
    t0 = time.monotonic()
    log.info("loading %s for the first time, to learn its defaults and size", name)
    placed = k.policy.has(name) and k.policy.tier(name) == "disk"  # sized by its files' headers at start:
    # counted as loading from now on
    if placed:
        k.policy.loading_started(name)
    try:
        await k.pool.revive(model)  # its READY registers it in the policy, on disk (``worker_ready``)
    except Exception as exc:
        log.error("loading %s failed: %s", name, exc)  # ``revive`` left no worker: on disk, as the books say
        if placed:
            k.policy.load_failed(name, str(exc))
        k.moving.discard(name)
        if not isinstance(exc, Asleep):  # a level-2 sleep stopped it: not its files' fault, its jobs wait
            load_failed(k, model, str(exc))
        k.on_change()
        return str(exc)
    plan = None
    if k.policy.has(name):  # else no READY came (the daemon is stopping): nothing to place
        if not placed:
            k.policy.loading_started(name)
        k.policy.loaded(name, time.monotonic())
        k.metrics.model_loads_total.labels(name).inc()
        k.metrics.model_load_seconds.observe(time.monotonic() - t0)
        plan = k.policy.plan(name, None)
    k.moving.discard(name)
    if isinstance(plan, Evict):
        k._spawn_moves(plan.moves)
    elif plan is not None and not isinstance(plan, Fits):
        await k._carry((Move(name, "device", "disk", f"its first load showed it does not fit: {plan.reason}"),))
    k.on_change()
    return None
