"""Moves off the device that no job asks for, carried out for the keeper: a sleep's, and expired keep-alives'.

Functions of the keeper (``keeper.py`` keeps a one-line method for each), split off it so that it keeps the
moves a dispatch asks for and this module the ones a timer, a sleep or a turn (``yield_turn``) asks for, and
how any move off a device or out of host memory is carried out (``carry``).

Every decision's moves (an expiry's, a sleep's, and through ``Keeper._spawn_moves`` a dispatch's, a pressure
watch's, an OOM's, an unload's) run side by side (awaited in turn, one large model's slow copy to host
memory would hold every other model past its keep-alive), but not a copy into host memory before the
drops out of host memory that make its room (``--host-memory``): the policy counted those bytes as free
when it booked the copy, and they are not free until the dropped model's worker has stopped (issue 27). The
frees of host copies kept by models on their devices (``decisions.Release``) make room as the drops do, and go
with them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from diffusiond.daemon.metrics import Metrics
from diffusiond.daemon.residency.batches import Go
from diffusiond.daemon.residency.decisions import (
    WAITING_FOR_MEMORY,
    Evict,
    ModelStatus,
    Move,
    Release,
    reason_label,
)
from diffusiond.daemon.residency.policy import Residency, ResidencyError
from diffusiond.daemon.residency.turns import Ended, Hold, Turns
from diffusiond.daemon.residency.working import Shape
from diffusiond.daemon.workers.pool import Model, WorkerPool
from diffusiond.protocol import WorkerState

log = logging.getLogger("diffusiond.daemon.residency.keeper")  # one logger for residency's moves


class Keeper(Protocol):
    """What these functions need of ``keeper.Keeper`` (named here so the two modules do not import each other)."""

    pool: WorkerPool
    policy: Residency
    metrics: Metrics
    on_change: Callable[[], None]
    moving: set[str]

    turns: Turns
    _asked: dict[str, Shape]
    _held: dict[str, str]

    def known(self, name: str) -> bool: ...
    def kept(self, model: Model) -> None: ...
    def snapshot(self) -> dict[str, ModelStatus]: ...
    def may_dispatch(self, model: Model, shape: Shape | None) -> Go | None: ...
    def _spawn_moves(self, moves: tuple[Move, ...]) -> None: ...
    def _carry(self, moves: tuple[Move, ...]) -> Coroutine[Any, Any, None]: ...
    def _start(self, coro: Coroutine[Any, Any, None]) -> None: ...
    def _book(self, model: Model, move: Move) -> bool: ...
    def _pending_unloads(self) -> None: ...
    def _log_end(self, e: Ended) -> None: ...


def yield_turn(k: Keeper, model: Model, hold: Hold) -> None:
    """A held model takes no new batch. Once those it runs are done it leaves its device, unless the
    model it yields to can go without that (room for its working memory may have been all it lacked)."""
    name = model.name
    status = k.snapshot()
    if status[name].running or status[name].residency != "device" or name in k.moving:
        return
    other = k.pool.models.get(hold.for_model)
    if other is not None and (other.name in k.moving or status[other.name].running):
        return  # it loads, or it runs already (its turn has begun: the hold ends at the next dispatch)
    if other is not None and other.name not in k.turns.holds:
        k.may_dispatch(other, k._asked.get(other.name))
        if other.name in k.moving or k._held.get(other.name) != WAITING_FOR_MEMORY:
            return  # it loads, or runs beside this one, at this dispatch
    got = k.policy.evict(name, f"it yields {hold.device} to {hold.for_model} (--max-model-wait)", queued_ok=True)
    if isinstance(got, Evict):
        k._spawn_moves(got.moves)


async def sleep(k: Keeper, model: Model, level: int, reason: str) -> None:
    """Off its device though jobs are queued (they wait for the wake). Level 1 goes where any move off the
    device goes (host memory on a GPU with room there, else disk), and leaves a model residency parked in
    host memory there (it holds no device memory, and its host copy cost a page-locked copy to make);
    level 2 goes straight to disk, from the device or from host memory: its workers stop, freeing all they held."""
    name = model.name
    if not k.known(name) or (level < 2 and k.policy.tier(name) != "device"):
        return  # never loaded, parked in host memory at level 1, or loading: the sleep says where it stayed
    got = k.policy.evict(name, reason, queued_ok=True)
    if not isinstance(got, Evict):
        return  # still running, loading or leaving: the sleep says what stayed
    moves = got.moves if level < 2 or not got.moves else (Move(name, k.policy.tier(name), "disk", reason),)
    await k._carry(moves)


Booked = tuple[list[tuple[Model, Move]], list[Release]]


def book(k: Keeper, moves: tuple[Move, ...]) -> Booked:
    """Every move booked with the policy now, in the caller's step: between a decision and its booking a job
    could be admitted and dispatched for a model the decision sends away. Those the policy
    refuses (the books moved on since the decision) are said and left out."""
    frees = [m for m in moves if isinstance(m, Release) and m.model in k.pool.models]
    booked = [(k.pool.models[m.model], m) for m in moves if m.model in k.pool.models and not isinstance(m, Release)]
    return [(model, m) for model, m in booked if k._book(model, m)], [m for m in frees if _book_release(k, m)]


async def carry_booked(k: Keeper, booked: Booked) -> None:
    """Moves ``book`` booked: side by side, but a copy into host memory only after the drops and frees."""
    moves, frees = booked
    drops = [(model, m) for model, m in moves if m.src == "host"]
    into_host = [(model, m) for model, m in moves if m.dst == "host"]

    async def after_drops() -> None:
        await asyncio.gather(*(carry(k, model, m) for model, m in drops), *(release(k, m) for m in frees))
        await asyncio.gather(*(carry(k, model, m) for model, m in into_host))

    await asyncio.gather(after_drops(), *(carry(k, model, m) for model, m in moves
                                          if (model, m) not in drops and (model, m) not in into_host))


async def carry(k: Keeper, model: Model, move: Move) -> None:
    """A booked move off the device or out of host memory (``Keeper._book``): SLEEP to host memory, else the
    workers stop; its end, or its failure, is told to the policy and ends the model's turn hold."""
    name = model.name
    t0 = time.monotonic()
    try:
        if move.dst == "host":
            await k.pool.sleep_model(model)
        else:
            await k.pool.retire(model)
    except Exception as exc:
        log.error("moving %s to %s failed: %s", name, move.dst, exc)
        k.policy.unload_failed(move, str(exc))
        if (drop := _to_disk(k, model, move, str(exc))) is not None:
            _left(k, drop, move, t0)
        ended = k.turns.release(name, f"its move off {move.src} failed", time.monotonic())
        if ended is not None:
            k._log_end(ended)
    else:
        _left(k, move, move, t0)
    finally:
        k.moving.discard(name)
        k._pending_unloads()
        k.on_change()


def _left(k: Keeper, done: Move, asked: Move, t0: float) -> None:
    """``done`` is over (``asked``, or the drop to disk that a half-done ``asked`` became): booked, and counted under
    the reason it was asked for."""
    kept = k.policy.kept(done.model) if done.dst == "disk" else 0  # its workers stopped: their copy went with them
    k.policy.unloaded(done)
    log.info("%s left %s for %s in %.0f ms", done.model, done.src, done.dst, (time.monotonic() - t0) * 1000)
    k.metrics.kept_released("disk", kept)
    k.metrics.model_evictions_total.labels(done.model, reason_label(asked.reason)).inc()


def _to_disk(k: Keeper, model: Model, move: Move, reason: str) -> Move | None:
    """A move into host memory that some of the model's workers made and another did not: the pool stopped them
    all (``WorkerPool.sleep_model``), so the model is on disk, booked so here, and its next job loads it anew on
    every device. None where its workers stand where they were (none moved)."""
    if move.dst != "host" or not model.retired:
        return None
    drop = Move(model.name, "device", "disk", f"{move.reason}; its move to host memory failed on a worker ({reason}), "
                                              "so it went to disk")
    try:
        k.policy.unloading(drop)
    except ResidencyError as exc:  # the books moved on (it runs): said, and left as they are
        log.error("residency: %s", exc)
        return None
    return drop


def _book_release(k: Keeper, move: Release) -> bool:
    try:
        k.policy.unloading(move)
    except ResidencyError as exc:
        log.error("residency: %s", exc)
        return False
    log.info("%s frees its host copy: %s", move.model, move.reason)
    return True


async def release(k: Keeper, move: Release) -> None:
    """The model's workers free the host copy of its weights they keep (booked by ``_book_release``); it stays
    on its device, serving, and is not ``moving``. What they keep after, said in their answers, is counted."""
    model = k.pool.models[move.model]
    before = k.policy.kept(move.model)
    failed = None
    try:
        await k.pool.release_host(model)
    except Exception as exc:
        log.error("freeing the host copy of %s failed: %s", move.model, exc)
        failed = str(exc)
    with contextlib.suppress(ResidencyError):  # its worker died meanwhile: worker_died settled the books
        if failed is None:
            k.policy.unloaded(move)
        else:
            k.policy.unload_failed(move, failed)
    k.kept(model)
    if k.policy.tier(move.model) == "device":  # else a death or a move to disk freed the copy, and counted it
        k.metrics.kept_released("host_memory_full", before - k.policy.kept(move.model))


async def expire_forever(k: Keeper, every_s: float) -> None:
    """Every ``every_s``, the models whose keep-alive ran out leave, in a task of their own (the
    next check does not wait for a slow copy; ``carry_booked`` keeps host memory within its bound)."""
    while True:
        await asyncio.sleep(every_s)
        moves = tuple(m for m in k.policy.expired(time.monotonic()) if _may_leave(k, m))
        if moves:  # booked in this step, as they were decided; carried in a task
            k._start(carry_booked(k, book(k, moves)))


def _may_leave(k: Keeper, move: Move) -> bool:
    model = k.pool.models.get(move.model)
    return model is not None and move.model not in k.moving and any(
        w.state in (WorkerState.READY, WorkerState.SLEEPING) for w in model.workers)
