"""Room for the batch a dispatch sends, not only for its first output (``Keeper.may_dispatch``).

Planned at batch 1 alone, a model was let in beside an idle one whose room a batch of 8 then took, past
``--device-memory`` (the books hold only what was free, so they never showed it). So the engine asks before each
dispatch with its oldest queued output's shape and the number of outputs the scheduler would send with it
(``Scheduler.forming``: those behind it of the same size and parameters, up to the model's largest batch; not the
whole queue, whose outputs of other sizes go in batches of their own, for which idle models would leave for
nothing). Once batch 1 fits, that batch is planned too: idle models leave for it, and it waits for other models'
runs or moves that will give its room back. Where nothing will (a pinned model, one with queued work, memory other
programs hold, a batch whose measured floor is past the budget), waiting would hold the queue for good, and the full
batch would run past the budget (or into the worker's out-of-memory retry): the batch goes at the largest size whose
working memory fits what is free (``Go.most``), and the rest follows in batches of that size.

Pure, as ``policy.py`` is: it reads the books and answers with a decision, which the keeper carries out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from dataclasses import dataclass

from diffusiond.daemon.residency.decisions import Evict, Fits, Wait
from diffusiond.daemon.residency.policy import Residency
from diffusiond.daemon.residency.working import Shape
from diffusiond.daemon.workers.pool import Model


@dataclass(frozen=True)
class Go:
    """The model takes batches now, of at most ``most`` outputs (None: as many as its ``max_batch``)."""

    most: int | None = None


def room(policy: Residency, model: Model, shape: Shape | None, batch: int,
         moving: Collection[str]) -> Go | Evict | Wait:
    """``model``, which fits at ``shape`` (None: no job asks), with ``batch`` outputs for its next batch (as many as
    the scheduler would send): Go; or Evict, the moves that make its batch's room, after which it is asked again; or
    Wait, while runs and moves (``moving``) of other models will give that room back."""
    if shape is None or batch <= shape.batch:
        return Go()
    plan = policy.plan(model.name, dataclasses.replace(shape, batch=batch))
    if isinstance(plan, Fits):
        return Go()
    if isinstance(plan, Evict) or (isinstance(plan, Wait) and _others_busy(policy, model, moving)):
        return plan
    return Go(_most(policy, model, shape, batch))


def _others_busy(policy: Residency, model: Model, moving: Collection[str]) -> bool:
    """Another model on one of its devices runs or moves: its end gives memory back and dispatches again. The
    model's own runs do not count: a worker computes one batch at a time, and its next waits behind it."""
    devices = set(model.config.devices)
    return any(s.name != model.name and (s.running or s.name in moving) and devices & set(s.per_device)
               for s in policy.snapshot())


def _most(policy: Residency, model: Model, shape: Shape, batch: int) -> int:
    """The largest batch, up to ``batch``, whose working memory (as a plan estimates it) fits what is free on each
    of the model's devices; at least 1, which the plan let go. The model's own runs on a device its one worker there
    computes count as free: the batch sent behind them starts once they are done, with their memory."""
    devices = model.config.devices
    free = min(policy.free(d) + (policy.running_on(model.name, d) if devices.count(d) == 1 else 0)
               for d in set(devices))
    most = 1
    while most < batch and policy.estimate(model.name, dataclasses.replace(shape, batch=most + 1)).nbytes <= free:
        most += 1
    return most
