"""Each request of a batch on the compute thread ends exactly once, whichever path ends it.

Apart from ``compute.py`` because several paths end requests (cancelled while queued, an input that cannot be
read, a failed or cancelled forward, a half refused ``out_of_memory`` by ``retry.py``) and a request two of them
reach must still get one RequestEnded: the record of which have ended, and the words and code each ending
carries, live here, shared by the compute thread and its retry.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from diffusiond.ipc.messages import EndStatus, RequestEnded
from diffusiond.pipelines.base import Interrupted
from diffusiond.protocol import ErrorCode
from diffusiond.worker.adapters import AdapterOutOfMemory
from diffusiond.worker.state import SharedState

log = logging.getLogger("diffusiond.worker.compute")  # the compute thread's lines, named as they always were


class Endings:
    """The endings of one batch's requests (``batch_id``): each posts its RequestEnded once, stage ``computing``.

    ``post`` and ``empty_cache`` (the allocator's cached blocks back) are the compute thread's; the out-of-memory
    retry posts its ``oom_retry`` and empties the cache through them too, so it needs nothing else of the thread."""

    def __init__(self, batch_id: int, state: SharedState, post: Callable[..., None],
                 empty_cache: Callable[[], None]) -> None:
        self.batch_id = batch_id
        self.state = state
        self.post = post
        self.empty_cache = empty_cache
        self._ended: set[str] = set()  # the batch's requests already ended: each ends exactly once

    def fail_all(self, request_ids: list[str], message: str) -> None:
        for rid in request_ids:
            self.end(rid, "failed", message)

    def failed(self, request_ids: list[str], exc: Exception) -> None:
        """A failure of these requests' forward that leaves the device sound: each ends with it, in its own words;
        a LoRA that did not fit in the device's memory ends them ``out_of_memory``, saying what would help."""
        log.error("batch %d: %s failed", self.batch_id, ", ".join(request_ids), exc_info=exc)
        oom = isinstance(exc, AdapterOutOfMemory)
        if oom:
            self.empty_cache()  # the half-loaded adapter's blocks: back before the next batch
        for rid in request_ids:
            self.end(rid, "failed", str(exc) if oom else f"{type(exc).__name__}: {exc}",
                     code=ErrorCode.OUT_OF_MEMORY if oom else "")

    def cancelled(self, request_ids: list[str], exc: Interrupted) -> None:
        for rid in request_ids:
            self.end(rid, "cancelled", f"cancelled during compute ({exc})")

    def end(self, request_id: str, status: EndStatus, message: str, code: str = "") -> None:
        if request_id in self._ended:  # ended by the out-of-memory path already: once only
            return
        self._ended.add(request_id)
        self.state.finish(request_id)
        self.post(RequestEnded(request_id, self.batch_id, status, message, "computing", code=code))
