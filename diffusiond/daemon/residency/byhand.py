"""Moves by hand, carried out for the keeper: ``POST /v1/models/{name}/load`` and ``/unload``.

A load by hand waits for the load it starts and answers with how it ended: on the device, or the worker's
reason when the load failed (``ondemand.load_failed``), rather than polling until a timeout that would hide
it. An unload by hand of a model with work (jobs queued or running, or a load under way) is remembered and
carried out once that work is done (``pending``, asked at each batch's end, each job leaving the queue and
each move's end), so that ``unload`` never answers as if it had done nothing; the model's entry says
``"unload": "pending"`` meanwhile.

Functions of the keeper (``keeper.py`` keeps a one-line method for each), split off it as ``ondemand.py`` is.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Coroutine
from typing import Any, Protocol

from diffusiond.daemon.config import DaemonConfig
from diffusiond.daemon.residency.batches import Go
from diffusiond.daemon.residency.decisions import Evict, Fits, ModelStatus, Move, TooLarge, Wait, failed_load
from diffusiond.daemon.residency.ondemand import LoadFailed
from diffusiond.daemon.residency.policy import Residency
from diffusiond.daemon.workers.pool import Model, WorkerPool

log = logging.getLogger("diffusiond.daemon.residency.keeper")  # one logger for residency's moves


class Keeper(Protocol):
    """What these functions need of ``keeper.Keeper`` (named here so the two modules do not import each other)."""

    config: DaemonConfig
    pool: WorkerPool
    policy: Residency
    moving: set[str]
    failed: dict[str, str]
    unloads: dict[str, str]

    def may_dispatch(self, model: Model, shape: Any) -> Go | None: ...
    def _carry(self, moves: tuple[Move, ...]) -> Coroutine[Any, Any, None]: ...
    def _spawn_moves(self, moves: tuple[Move, ...]) -> None: ...


async def load(k: Keeper, model: Model) -> None:
    """Onto its device, making room as the policy says; a model whose last load failed is tried again.
    Bounded as a worker's start is (``worker_start_timeout_s``): a load from disk is one. Raises ValueError
    (it cannot fit), LoadFailed (the worker's reason) or TimeoutError."""
    name = model.name
    k.failed.pop(name, None)
    k.unloads.pop(name, None)  # the latest word stands: an unload still waiting is called off
    limit = k.config.worker_start_timeout_s
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        plan = k.policy.plan(name, None)
        if isinstance(plan, TooLarge):
            raise ValueError(plan.reason)
        if isinstance(plan, Fits) and plan.load_from is None and name not in k.moving:
            return
        if name in k.failed:
            raise LoadFailed(f"model {name!r} could not be loaded: {k.failed[name]}")
        if name not in k.moving:
            k.may_dispatch(model, None)
        await asyncio.sleep(0.1)
    raise TimeoutError(f"{name} did not load within {limit:g} s (worker_start_timeout_s)")


async def unload(k: Keeper, model: Model, reason: str, *, later: bool = True) -> None:
    """Off its device (or out of host memory) now if it has no work, else once its work is done (``later``;
    without it, a model with work stays). A model the policy does not know yet has never been loaded (on
    disk since the start): nothing to do."""
    name = model.name
    got = k.policy.evict(name, reason) if k.policy.has(name) else None
    if isinstance(got, Wait) and later:
        k.unloads[name] = reason
        log.info("%s leaves once its work is done (%s): %s", name, got.reason, reason)
        return
    k.unloads.pop(name, None)
    if isinstance(got, Evict):  # booked at once (a job admitted meanwhile waits for its load), carried in order
        await k._carry(got.moves)


def pending(k: Keeper) -> None:
    """Carry out the unloads by hand whose models' work is done."""
    for name, reason in list(k.unloads.items()):
        if name in k.moving:
            continue  # asked again when the move ends
        got = k.policy.evict(name, reason)
        if isinstance(got, Evict):
            del k.unloads[name]
            log.info("%s: its work is done, the unload by hand goes ahead", name)
            k._spawn_moves(got.moves)


def snapshot(k: Keeper) -> dict[str, ModelStatus]:
    """The policy's picture, with each pending unload by hand, and each model never placed (its size not
    known) whose load failed: on disk, with the reason, as one the policy knows would show it."""
    out = {s.name: dataclasses.replace(s, unload_pending=s.name in k.unloads) for s in k.policy.snapshot()}
    for name, why in k.failed.items():
        model = k.pool.models.get(name)
        if name not in out and model is not None:
            out[name] = ModelStatus(name, model.config.devices[0], "disk", 0, 0, None, False, model.config.pinned,
                                    0, 0, failed_load(why), per_device=dict.fromkeys(model.config.devices, 0))
    return out
