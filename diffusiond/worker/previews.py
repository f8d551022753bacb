"""Previews in the worker: a step's picture -> an arena slot -> PREVIEW_READY, from the forward's thread.

Outputs go through the copy thread; previews do not, because of the GIL. An eager forward is
bound by its host thread (the GPU waits for its launches), and each torch op releases and
retakes the GIL: when another thread of the process wants it, the forward's thread loses it for
a while and runs slower while the two hand it back and forth. The copy thread took it a dozen
times per preview (the conversion's ops, the copy, the wait, the post), which cost an SDXL
forward at 1024² about 3 % with a preview every step on the H200 (docs/benchmarks.md). So the
forward's thread does a preview's few launches itself and never waits:

- ``offer`` (inside the step callback) takes a slot without waiting (no room: no preview), queues
  the picture's copy into it with ``non_blocking`` on the forward's stream (the arena is
  registered with CUDA: the copy engine writes it while the next step computes; a 256 px picture
  is 192 KiB, microseconds of the stream) and marks it with an event;
- ``flush`` (after every step) posts the previews whose event has passed and leaves the others;
- ``take_pending`` (after the forward) hands what is still in flight to the copy thread, which
  waits for it and posts it (``finish``) before the batch's outputs.

At most ``PREVIEW_SLOTS`` previews are in flight or held by the engine at once; the engine gives
each slot back once it has encoded the picture (``release``). Outputs never wait for previews.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from diffusiond.ipc.arena import Arena
from diffusiond.ipc.errors import ArenaError
from diffusiond.ipc.messages import PreviewReady
from diffusiond.ipc.tensors import describe, nbytes_of, write_tensor
from diffusiond.worker.state import SharedState

log = logging.getLogger(__name__)

# Previews in flight or held by the engine (until it has encoded them), per worker. A preview is
# small and the engine frees it within milliseconds, so a few cover every request of a batch;
# beyond them previews are skipped, never waited for.
PREVIEW_SLOTS = 16


@dataclass
class PendingPreview:
    ready: PreviewReady  # what to post once the copy has landed
    event: torch.cuda.Event | None  # recorded after the copy; None on CPU (copied already)

    @property
    def done(self) -> bool:
        return self.event is None or self.event.query()


class PreviewOutbox:
    """One worker's previews, from a slot to the engine; ``offer``/``flush`` on the forward's thread."""

    def __init__(self, arena: Arena, state: SharedState, post: Callable[..., None], *, cuda: bool) -> None:
        self.arena = arena
        self.state = state
        self.post = post
        self.cuda = cuda
        self._lock = threading.Lock()
        self._slots: set[int] = set()  # taken by offer, until released (engine) or discarded
        self._pending: deque[PendingPreview] = deque()  # the forward's thread only

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._slots)

    def offer(self, batch_id: int, request_id: str, step: int, total: int, picture: torch.Tensor) -> bool:
        """Queue ``picture`` (uint8 (H, W, 3), any device) for the engine; False: skipped."""
        if self.state.is_cancelled(request_id) or self.in_flight >= PREVIEW_SLOTS:
            return False
        try:
            slot = self.arena.try_allocate(nbytes_of(picture))
        except ArenaError:  # larger than the whole arena: an output goes to a memfd of its own, a preview is skipped
            return False  # (raised, it failed the job)
        if slot is None:  # the arena is busy with outputs: they come first
            return False
        try:
            host = write_tensor(self.arena.buffer(slot), picture, non_blocking=self.cuda)
            event = None
            if self.cuda:
                event = torch.cuda.Event(blocking=True)  # the copy thread may wait on it: sleep, not spin
                event.record()
        except Exception:
            self.arena.release(slot.id)
            log.exception("preview of %s at step %d failed; skipped", request_id, step)
            return False
        with self._lock:
            self._slots.add(slot.id)
        ready = PreviewReady(request_id, batch_id, step, total, describe(host, slot.id, slot.offset))
        self._pending.append(PendingPreview(ready, event))
        return True

    def flush(self) -> None:
        """Post the previews whose copy has landed (in order: one stream), without waiting."""
        while self._pending and self._pending[0].done:
            self.post(self._pending.popleft().ready)

    def take_pending(self) -> list[PendingPreview]:
        """What is still in flight after a forward, for the copy thread to ``finish``."""
        pending = list(self._pending)
        self._pending.clear()
        return pending

    def finish(self, preview: PendingPreview) -> None:
        """On the copy thread: wait for the copy, then post it (or give the slot back)."""
        slot_id = preview.ready.tensor.slot_id
        try:
            if preview.event is not None:
                preview.event.synchronize()
        except Exception:
            log.exception("preview of %s at step %d failed; skipped", preview.ready.request_id, preview.ready.step)
            self.release(slot_id)
            return
        if self.state.is_cancelled(preview.ready.request_id):
            self.release(slot_id)
        else:
            self.post(preview.ready)

    def release(self, slot_id: int) -> bool:
        """Give a preview's slot back; False: not a preview's slot."""
        with self._lock:
            if slot_id not in self._slots:
                return False
            self._slots.discard(slot_id)
        self.arena.release(slot_id)
        return True
