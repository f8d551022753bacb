"""Admission and batching: which queued outputs go to a worker next, and together with what.

Pure bookkeeping with no I/O, so its rules are easy to read and test:

- admission is bounded (``queue_size`` jobs waiting): the engine refuses a job while ``full``;
- a batch always starts from the oldest waiting item of a model and takes the items behind it
  that share its batch key (size, steps, guidance, frames, scheduler, output dtype), up to the
  model's ``max_batch`` (its own, else the daemon's; and at most ``MAX_FDS`` edits with their own
  input image: each goes to the worker as one fd of the batch's frame); so an item with another key
  waits for at most one batch;
- with ``batch_wait`` > 0 a partial batch is held back until its oldest item has waited that
  long, to give compatible requests a chance to join;
- ``partial_ok=False`` asks for a full batch or nothing: the engine uses it for a worker that is
  still busy, so a half-empty batch is not committed to it while the requests that would fill it
  are still on their way (it would otherwise shrink every following batch);
- a model's batches form only in the sizes ``sizes`` gives it (``batch_sizes``): a run of compatible
  items longer than one size and shorter than the next goes as the smaller, the rest stays at the
  head of the queue in its order, so the oldest item still starts the next batch.

Why sizes at all: a compiled model (``--compile``) has one graph per batch size (a CUDA graph with
``reduce-overhead``), so each new size costs a compile mid-traffic, and ``compile_shapes`` bounds how
many it keeps. Under load the queue forms batches of whatever happens to be waiting (3, 5, 6, 7 ...);
in powers of two a compiled model needs log2(max_batch) + 1 graphs, all of which ``--warmup WxH:all``
compiles before the daemon is ready. Rounding down loses little: the items left over head the next
batch, which the queue behind them fills. ``max_batch`` itself is always a size, so a "full" batch
(``partial_ok=False``) is max_batch as before, and a max_batch that is no power of two (6) still
forms (1, 2, 4, 6). An eager model keeps every size by default (``--batch-sizes auto``): it compiles
nothing, so a rounded-down batch would only cost throughput. ``--batch-sizes pow2|any`` overrides it
for every model (a ``[[models]]`` table's own ``batch_sizes`` for that one): ``any`` for a compiled
model warmed at its largest batch only, whose smaller batches run padded into that graph
(pipelines/compile.py), ``pow2`` to try the compiled rule eager.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from diffusiond.ipc.frames import MAX_FDS

if TYPE_CHECKING:  # config.py reads batch_sizes here, and jobs.py imports config.py
    from diffusiond.daemon.core.jobs import Item, Job


@dataclass(frozen=True)
class Wait:
    """No batch yet; ask again at ``until`` (monotonic seconds)."""

    until: float


def batch_sizes(max_batch: int, pow2: bool) -> tuple[int, ...]:
    """The sizes batches form in: every size up to ``max_batch``, or the powers of two below it and
    ``max_batch`` itself (so a full batch is still a size)."""
    if not pow2:
        return tuple(range(1, max_batch + 1))
    sizes = [1]
    while sizes[-1] * 2 < max_batch:
        sizes.append(sizes[-1] * 2)
    return (*sizes, max_batch) if max_batch > 1 else (1,)


class Scheduler:
    def __init__(self, *, queue_size: int, max_batch: int, batch_wait_s: float,
                 sizes: Mapping[str, Sequence[int]] | None = None) -> None:
        """``sizes``: the batch sizes each model's batches form in (``batch_sizes``), the largest of which is
        that model's full batch (models have their own ``max_batch``); a model not in it takes any size up to
        ``max_batch``."""
        self.queue_size = queue_size
        self.max_batch = max_batch
        self.batch_wait_s = batch_wait_s
        self.sizes = dict(sizes or {})
        self._pending: dict[str, collections.deque[Item]] = collections.defaultdict(collections.deque)
        self._queued_jobs: dict[str, Job] = {}

    @property
    def depth(self) -> int:
        """Jobs with at least one output not yet sent to a worker."""
        return len(self._queued_jobs)

    @property
    def full(self) -> bool:
        return len(self._queued_jobs) >= self.queue_size

    def admit(self, job: Job) -> None:
        """Queue a job's items; the caller checked ``full`` first."""
        self._queued_jobs[job.id] = job
        self._pending[job.request.model].extend(job.items)

    def remove(self, job: Job) -> list[Item]:
        """Take a job's waiting items out of the queue (cancel, deadline, shutdown)."""
        if self._queued_jobs.pop(job.id, None) is None:
            return []
        q = self._pending[job.request.model]
        mine = [i for i in q if i.job is job]
        if mine:
            self._pending[job.request.model] = collections.deque(i for i in q if i.job is not job)
        return mine

    def requeue_front(self, items: list[Item]) -> None:
        """Put items back at the head (a dispatch that could not be sent)."""
        for item in reversed(items):
            self._pending[item.job.request.model].appendleft(item)
            self._queued_jobs.setdefault(item.job.id, item.job)

    def waiting(self, model: str) -> list[Job]:
        """The jobs with outputs queued for ``model``, in queue order (residency shows them why they wait)."""
        return list({i.job.id: i.job for i in self._pending[model]}.values())

    def outputs(self, model: str) -> int:
        """How many of ``model``'s outputs wait to be sent to a worker (residency counts them as its work)."""
        return len(self._pending.get(model, ()))

    def oldest(self, model: str) -> float | None:
        """When ``model``'s longest-waiting queued output was admitted (the queue is in admission order, and
        what goes back goes to its head), or None: residency bounds that wait (residency/turns.py)."""
        q = self._pending.get(model)
        return q[0].enqueued_at if q else None

    def full_batch(self, model: str) -> int:
        """The most items one of ``model``'s batches takes: its largest size."""
        return max(self.sizes[model]) if model in self.sizes else self.max_batch

    def forming(self, model: str) -> int:
        """How many outputs ``model``'s next batch takes, were it sent now: residency plans its room (only items of
        one batch key go together, so a queue of mixed sizes forms no batch of its whole length)."""
        q = self._pending.get(model)
        return self._sized(model, len(self._gather(q, self.full_batch(model)))) if q else 0

    def next_batch(self, model: str, now: float, *, partial_ok: bool = True,
                   most: int | None = None) -> list[Item] | Wait | None:
        """``most``: the most items the batch may take now (residency: the largest batch that fits the device), which
        is then a full batch: nothing that could join it would fit."""
        q = self._pending[model]
        if not q:
            return None
        full = self.full_batch(model) if most is None else max(1, min(most, self.full_batch(model)))
        head = q[0]
        batch = self._gather(q, full)
        if len(batch) < full and not partial_ok:
            return None
        if len(batch) < full and self.batch_wait_s > 0:
            until = head.enqueued_at + self.batch_wait_s
            if now < until:
                return Wait(until)
        batch = batch[:self._sized(model, len(batch))]  # the items after it keep their places
        taken = {id(i) for i in batch}
        self._pending[model] = collections.deque(i for i in q if id(i) not in taken)
        for job in {i.job.id: i.job for i in batch}.values():
            if not any(i.job is job for i in self._pending[model]):
                self._queued_jobs.pop(job.id, None)
        return batch

    @staticmethod
    def _gather(q: collections.deque[Item], full: int) -> list[Item]:
        """The oldest item and those behind it that share its batch key, up to ``full``."""
        head = q[0]
        key = head.job.request.batch_params()
        batch = [head]
        inputs = {head.job.id} if head.job.request.buffer is not None else set()
        for item in list(q)[1:]:
            if len(batch) >= full:
                break
            if item.job.request.batch_params() == key:
                if item.job.request.buffer is not None and item.job.id not in inputs:
                    if len(inputs) >= MAX_FDS:  # each edit's input travels as one fd of the frame
                        continue
                    inputs.add(item.job.id)
                batch.append(item)
        return batch

    def _sized(self, model: str, n: int) -> int:
        """The largest of the sizes ``model``'s batches form in that takes at most ``n`` items."""
        return max(s for s in self.sizes[model] if s <= n) if model in self.sizes else n
