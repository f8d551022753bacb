"""Outputs: from a slot in a worker's arena to bytes a client can fetch.

Encoded formats (PNG, JPEG, WebP, GIF, MP4) are produced in a thread pool straight from the
read-only mapping (no copy), and the slot goes back to the worker as soon as the encoder is
done. ``npy`` outputs are not encoded at all: the HTTP layer streams a header and then the
slot's own bytes; such a slot is held until the job's retention ends or the job is released.

A slot that something is still reading is "pinned"; a release while pinned is deferred to the
last unpin, so a slot is never handed back while an encoder or a response reads it.

An npy slot goes back to the worker as soon as the output has been streamed once. Outputs that
nobody fetches would hold their slots until retention ends; when they take more than half of a
worker's arena, the oldest are spilled (copied once into engine memory, off the loop) so the
arena never fills for good and new outputs keep the zero-copy path.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Executor
from typing import TYPE_CHECKING

import numpy as np

from diffusiond.daemon.encoders import EncodeOptions, content_type, encode, npy_header, npy_size
from diffusiond.daemon.jobs import Item, Job, Stage

if TYPE_CHECKING:
    from diffusiond.daemon.engine import Engine

log = logging.getLogger(__name__)


class Outputs:
    def __init__(self, engine: Engine, executor: Executor) -> None:
        self.engine = engine
        self.executor = executor
        self._tasks: set[asyncio.Task[None]] = set()

    def deliver(self, item: Item) -> None:
        """An item's output has landed in shared memory; make it servable."""
        fmt = item.job.request.output_format
        item.content_type = content_type(fmt)
        if fmt == "npy":
            assert item.desc is not None and item.worker is not None
            item.nbytes = npy_size(np.dtype(_np_dtype(item.desc.dtype)), item.desc.shape)
            self.engine.item_ready(item)
            self.relieve(item.worker)
            return
        task = asyncio.ensure_future(self._encode(item, fmt))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def options(self, item: Item) -> EncodeOptions:
        """What the file says about itself (PNG tEXt, MP4 comment): enough to reproduce it."""
        r = item.job.request
        meta = {"prompt": r.prompt, "model": r.model, "seed": str(item.seed), "steps": str(r.steps),
                "guidance_scale": f"{r.guidance:g}", "size": f"{r.width}x{r.height}", "software": "diffusiond"}
        if r.negative_prompt:
            meta["negative_prompt"] = r.negative_prompt
        return EncodeOptions(png_compress_level=self.engine.config.png_compress_level, fps=r.fps, metadata=meta)

    async def _encode(self, item: Item, fmt: str) -> None:
        assert item.worker is not None and item.desc is not None
        job = item.job
        opts = self.options(item)
        array = item.worker.array(item.desc)
        self.pin(item)
        t0 = time.perf_counter()
        try:
            data = await asyncio.get_running_loop().run_in_executor(self.executor, encode, array, fmt, opts)
        except Exception as exc:
            log.exception("encoding %s of %s failed", fmt, item.request_id)
            self.engine.item_failed(item, f"encoding the output as {fmt} failed: {exc}", Stage.ENCODING)
            return
        finally:
            del array
            self.unpin(item)
        ms = (time.perf_counter() - t0) * 1000
        job.add_timing("encode", ms)
        self.engine.metrics.stage_seconds.labels("encode").observe(ms / 1000)
        self.release(item)  # the bytes are ours now; the slot goes back to the worker
        if job.terminal:
            return
        item.data = data
        item.nbytes = len(data)
        self.engine.item_ready(item)

    # slot lifetime --------------------------------------------------------------------------
    def pin(self, item: Item) -> None:
        item.pins += 1

    def unpin(self, item: Item) -> None:
        item.pins -= 1
        if item.pins == 0 and item.release_pending:
            item.release_pending = False
            self.release(item)

    def release(self, item: Item) -> None:
        if item.desc is None:
            return
        if item.pins:
            item.release_pending = True
            return
        desc, item.desc = item.desc, None
        if item.worker is not None:
            item.worker.release(desc)

    def release_all(self, job: Job) -> None:
        for item in job.items:
            self.release(item)
            item.data = None

    def relieve(self, worker: object, need: int = 0) -> None:
        """Spill the oldest unfetched npy outputs: while they hold over half of the worker's arena,
        or (``need`` > 0, the worker is waiting for a slot) until ``need`` more bytes are free."""
        capacity = getattr(worker, "arena_capacity", 0)
        held_bytes = getattr(worker, "held_bytes", 0)
        excess = max(need, held_bytes - capacity // 2)
        if not capacity or excess <= 0:
            return
        held = [i for i in self.engine.items.values()
                if i.worker is worker and i.desc is not None and i.done and not i.pins and not i.spilling]
        for item in sorted(held, key=lambda i: i.enqueued_at):
            if excess <= 0:
                break
            assert item.desc is not None
            excess -= item.desc.nbytes
            task = asyncio.ensure_future(self._spill(item))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _spill(self, item: Item) -> None:
        item.spilling = True
        self.pin(item)
        try:
            header, payload = self.npy_parts(item)
            data = await asyncio.get_running_loop().run_in_executor(self.executor, _join, header, payload)
            del payload
            item.data = data
        finally:
            self.unpin(item)
            item.spilling = False
        self.release(item)
        log.info("spilled output %s (%d bytes) out of the arena", item.request_id, len(data))

    def streamed(self, item: Item) -> None:
        """A client received the whole npy output: the slot's job is done."""
        self.release(item)

    # reading --------------------------------------------------------------------------------
    def npy_parts(self, item: Item) -> tuple[bytes, memoryview]:
        """Header and a zero-copy view of the payload; pin the item while writing them out."""
        assert item.worker is not None and item.desc is not None
        desc = item.desc
        header = npy_header(np.dtype(_np_dtype(desc.dtype)), desc.shape)
        buf = item.worker.buffer(desc)
        return header, buf[desc.offset : desc.offset + desc.nbytes]


def _np_dtype(name: str) -> str:
    return "uint16" if name == "bfloat16" else name  # numpy has no bfloat16: raw 16-bit words


def _join(header: bytes, payload: memoryview) -> bytes:
    return header + payload.tobytes()
