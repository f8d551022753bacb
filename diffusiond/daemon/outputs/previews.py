"""Previews in the engine: a worker's small picture -> encoded bytes on the item -> a PREVIEW event.

A preview's slot goes back to its worker as soon as it is encoded (or at once when nobody can use
it), so previews hold a few small slots for milliseconds and never crowd out outputs. One encode
per output runs at a time; a preview that arrives meanwhile waits, and a newer one replaces it
(counted in ``previews_dropped``): the pool is shared with the outputs' encodes, and only the
latest picture matters. The final output never goes through here.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Executor

from diffusiond.daemon.core.jobs import Item, Preview
from diffusiond.daemon.metrics import Metrics
from diffusiond.daemon.outputs.encoders import EncodeOptions, encode
from diffusiond.daemon.workers.link import WorkerLink
from diffusiond.ipc.messages import PreviewReady
from diffusiond.ipc.tensors import as_numpy

log = logging.getLogger(__name__)

# Previews are looked at for a moment: a lower quality than outputs' encodes is faster and smaller.
PREVIEW_OPTIONS = EncodeOptions(jpeg_quality=75, webp_quality=60, png_compress_level=1)


class Previews:
    def __init__(self, executor: Executor, metrics: Metrics, on_preview: Callable[[Item], None]) -> None:
        self.executor = executor
        self.metrics = metrics
        self._on_preview = on_preview
        self._encoding: set[Item] = set()
        self._waiting: dict[Item, tuple[WorkerLink, PreviewReady]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def deliver(self, worker: WorkerLink, item: Item | None, msg: PreviewReady) -> None:
        """A worker sent a preview of ``item`` (None: an item the engine no longer knows)."""
        if not _wanted(item):
            worker.return_slot(msg.tensor)
            return
        assert item is not None
        if item in self._encoding:
            older = self._waiting.pop(item, None)
            if older is not None:
                older[0].return_slot(older[1].tensor)
                self.metrics.previews_dropped.inc()
            self._waiting[item] = (worker, msg)
            return
        self._encoding.add(item)
        task = asyncio.ensure_future(self._encode(worker, item, msg))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def close(self) -> None:
        """The engine stops: waiting previews give their slots back."""
        for worker, msg in self._waiting.values():
            worker.return_slot(msg.tensor)
        self._waiting.clear()

    async def _encode(self, worker: WorkerLink, item: Item, msg: PreviewReady) -> None:
        try:
            while True:
                spec = item.job.request.preview
                assert spec is not None
                data = None
                try:
                    array = as_numpy(worker.buffer(msg.tensor), msg.tensor)
                    try:
                        loop = asyncio.get_running_loop()
                        data = await loop.run_in_executor(self.executor, encode, array, spec.format, PREVIEW_OPTIONS)
                    finally:
                        del array
                except Exception:
                    log.exception("encoding a preview of %s failed; skipped", item.request_id)
                finally:
                    worker.return_slot(msg.tensor)
                newer = item.preview is None or msg.step > item.preview.step
                if data is not None and newer and _wanted(item):
                    item.preview = Preview(item.index, msg.step, msg.total, spec.format, data)
                    self._on_preview(item)
                waiting = self._waiting.pop(item, None)
                if waiting is None:
                    return
                worker, msg = waiting
                if not _wanted(item):
                    worker.return_slot(msg.tensor)
                    return
        finally:
            self._encoding.discard(item)


def _wanted(item: Item | None) -> bool:
    """A preview still means something: its output is still being made."""
    return (item is not None and item.job.request.preview is not None and not item.job.terminal
            and not item.delivered)
