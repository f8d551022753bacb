"""Room for the batch a dispatch sends, not only for its first output (``Keeper.may_dispatch``).

The engine asks before each dispatch with its oldest queued output's shape, batch 1, and the scheduler then forms
a batch of up to the model's ``max_batch`` from what waits: planned at batch 1, a model was let in beside an idle
one whose room a batch of 8 then took, past ``--device-memory`` (the books hold only what was free, so they never
showed it). So once batch 1 fits, the batch the queue can form (its outputs, up to the model's largest batch: an
upper bound, as the default estimate errs towards evicting more) is planned too: idle models leave for it, and it
waits for other models' runs or moves that will give its room back. Where nothing will (memory other programs
hold, a batch whose measured floor is past the budget), it goes as before, tried on what is free: the worker's
out-of-memory retry runs it as halves, and waiting would hold the queue for good.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

from diffusiond.daemon.config import DaemonConfig
from diffusiond.daemon.residency.decisions import Evict, Move, Wait
from diffusiond.daemon.residency.policy import Residency
from diffusiond.daemon.residency.working import Shape
from diffusiond.daemon.workers.pool import Model


class Keeper(Protocol):
    """What this needs of ``keeper.Keeper`` (named here so the two modules do not import each other)."""

    config: DaemonConfig
    policy: Residency
    moving: set[str]
    queued: Callable[[str], int]
    _held: dict[str, str]
    _short: dict[str, tuple[str, ...]]

    def _spawn_moves(self, moves: tuple[Move, ...]) -> None: ...


def room(k: Keeper, model: Model, shape: Shape | None) -> bool:
    """``model``, which fits at ``shape``, may take a batch now: True, or False once the moves that make its
    batch's room have started, or while runs and moves of other models will give that room back."""
    name = model.name
    batch = min(k.queued(name), k.config.max_batch_of(model.config))
    if shape is not None and batch > shape.batch:
        plan = k.policy.plan(name, dataclasses.replace(shape, batch=batch))
        if isinstance(plan, Evict):
            k._spawn_moves(plan.moves)
            k._held.pop(name, None)
            return False
        if isinstance(plan, Wait) and _others_busy(k, model):
            k._held[name], k._short[name] = plan.stage, plan.short
            return False
    k._held.pop(name, None)
    return True


def _others_busy(k: Keeper, model: Model) -> bool:
    """Another model on one of its devices runs or moves: its end gives memory back and dispatches again. The
    model's own runs do not count: a worker computes one batch at a time, and its next waits behind it."""
    devices = set(model.config.devices)
    return any(s.name != model.name and (s.running or s.name in k.moving) and devices & set(s.per_device)
               for s in k.policy.snapshot())
