"""Outputs: from a slot in a worker's arena to bytes a client can fetch; the one owner of slots.

Every slot an output holds goes back to its worker from this module and nowhere else: after
encoding, after the one stream of an npy output, when its job fails or is cancelled, when the
job's retention ends, when the engine stops, and at once for an output that arrives for a job
that already ended. The engine tells this module what happened (``deliver``, ``discard``,
``expire``, ``drop_late``); it never hands a slot back itself. The side region beside an output (its
trajectory, its sound track) has an owner of its own, ``trajectories.py``, which this one holds and
tells the same news.

Encoded formats (PNG, JPEG, WebP, GIF, MP4) are produced in a thread pool straight from the
read-only mapping (no copy), and the slot goes back as soon as the encoder is done. ``npy``
outputs are not encoded: the HTTP layer streams a header and then the slot's own bytes, through
``open``, which pins the slot while it is read. A slot that something is still reading is never
handed back: a release while pinned is deferred to the last unpin.

Outputs that nobody fetches would hold their slots until retention ends; when they take more
than half of a worker's arena, the oldest are spilled (copied once into engine memory, off the
loop) so the arena never fills for good and new outputs keep the zero-copy path. A worker that
waits for room (SLOT_WAIT) needs one free range as long as its slot, not free bytes in pieces:
for it, those are spilled whose slots open such a range for the fewest bytes. Only arena slots
count and are spilled: an output larger than the arena lies in a memfd of its own, which holds
no arena room, so it stays there, mappable by fd, until its one delivery. A
spilled npy is still delivered once: its copy is dropped after its first complete read, as its
slot would have gone back.

When jobs persist (``store.py``), every output is also written to a file in the state dir before
it counts as ready (encoded bytes, or an npy's header and slot), in the same thread pool: the
memory copy of an encoded output is dropped, and an npy's slot serves the zero-copy paths until
it goes back. From then on reads come from the file (over HTTP a piece at a time as it is sent, off
the loop), so an output is fetchable any number of times, after its slot went back, and
after a restart. ``reading``
counts the reads of each job's files under way; retention and DELETE skip or wait for nothing
else (``deleting`` stops new reads of a job being deleted).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import Executor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from diffusiond.daemon.core.jobs import Item, Job
from diffusiond.daemon.errors import EngineError, NotShared, OutputReleased
from diffusiond.daemon.metrics import Metrics
from diffusiond.daemon.outputs import sound
from diffusiond.daemon.outputs.encoders import EncodeOptions, encode, npy_header, npy_size
from diffusiond.daemon.outputs.file_reads import FileRead, FileReads
from diffusiond.daemon.outputs.metadata import file_metadata
from diffusiond.daemon.outputs.trajectories import Trajectories
from diffusiond.daemon.state.store import Store
from diffusiond.daemon.workers.link import WorkerLink
from diffusiond.ipc.arena import ALIGN
from diffusiond.ipc.sidearrays import TrajectoryDesc
from diffusiond.ipc.tensors import TensorDesc, as_numpy, numpy_dtype
from diffusiond.protocol import FORMATS, ErrorCode, Stage, WorkerState

log = logging.getLogger(__name__)


@dataclass
class OutputRead:
    """One read of an output: ``header`` then ``payload`` (a view of shared memory for npy), or ``file``,
    its file in the state dir, open, to be read a piece at a time as it is sent.

    The reader sets ``complete`` once every byte went out: an npy slot has then done its job and
    goes back to the worker when the read ends."""

    header: bytes
    payload: bytes | memoryview
    complete: bool = False
    file: FileRead | None = None

    def __len__(self) -> int:
        return len(self.header) + len(self.payload) + (self.file.size if self.file is not None else 0)


class Outputs:
    def __init__(self, executor: Executor, metrics: Metrics, *, png_compress_level: int,
                 on_ready: Callable[[Item], None], on_failed: Callable[[Item, str, Stage, ErrorCode], None],
                 store: Store | None = None) -> None:
        self.executor = executor
        self.store = store or Store()
        self.files = FileReads(executor, self.store)  # reads of the state dir's files, against their deletion
        self.metrics = metrics
        self.png_compress_level = png_compress_level
        self._on_ready = on_ready
        self._on_failed = on_failed
        self.trajectories = Trajectories(executor, self.files)  # their side regions (trajectories.py)
        self._holding: set[Item] = set()  # items that hold a slot in a worker's arena
        self._tasks: set[asyncio.Task[None]] = set()

    # what the engine tells us ------------------------------------------------------------------
    def deliver(self, item: Item, desc: TensorDesc, trajectory: TrajectoryDesc | None = None) -> None:
        """An item's output (and its trajectory, when asked for) has landed in shared memory: make it servable."""
        self._leave_stopped()
        if trajectory is not None:
            self.trajectories.hold(item, trajectory)
        item.desc = desc
        self._holding.add(item)
        item.stage = Stage.ENCODING
        fmt = item.job.request.output_format
        if fmt == "npy":
            item.nbytes = npy_size(numpy_dtype(desc.dtype), desc.shape)
            if self.store.persistent:
                self._keep(self._persist_npy(item))
                return
            self._on_ready(item)
            assert item.worker is not None
            self.relieve(item.worker)
            return
        self._keep(self._encode(item, fmt))

    def drop_late(self, worker: WorkerLink, desc: TensorDesc) -> None:
        """An output nobody can use (its job ended first, or a duplicate): the slot goes back now."""
        worker.return_slot(desc)

    def discard(self, job: Job) -> None:
        """The job failed or was cancelled: nothing of it will be served."""
        for item in job.items:
            self._free(item)
            self.trajectories.free(item)

    def expire(self, job: Job) -> None:
        """Retention ended (or a synchronous caller took its bytes): forget every output."""
        for item in job.items:
            self._free(item)
            self.trajectories.free(item)
            item.data = None

    def close(self) -> None:
        """The engine stops: every slot goes back (its worker may already be gone)."""
        for item in list(self._holding):
            self._free(item)
        for item in list(self.trajectories.held):
            self.trajectories.free(item)

    async def settled(self) -> None:
        """Every encode and write under way has ended: waited, never cancelled (an encode reads a slot), because a
        write goes on to its clean-up in the engine's pool, which a pool already shut refused, the error logged."""
        while self._tasks:
            await asyncio.wait(set(self._tasks))

    # reading ------------------------------------------------------------------------------------
    @asynccontextmanager
    async def open(self, item: Item) -> AsyncIterator[OutputRead]:
        """Read one output; its slot stays pinned until the block ends."""
        self.check_readable(item)
        if item.data is not None and item.job.request.output_format == "npy":
            async with self._open_spilled(item, item.data) as read:
                yield read
            return
        if item.data is not None:
            yield OutputRead(b"", item.data)
            return
        if item.desc is None:  # so its file (check_readable): open, and counted in ``reading``, until the read ends
            assert item.file is not None
            async with self.files.open(item.job.id, item.file, f"output {item.index}", item.nbytes) as file:
                yield OutputRead(b"", b"", file=file)
            return
        self._pin(item)
        read = OutputRead(*self._npy_parts(item))
        try:
            yield read
        finally:
            complete = read.complete
            read.payload = b""  # drop the view of shared memory before the slot can go back
            self._unpin(item)
            if complete:
                self._free(item)

    @staticmethod
    def check_readable(item: Item) -> None:
        """What ``open`` refuses before it reads anything, for HEAD too: an output not ready yet, or an npy
        already delivered (it is sent once, then released)."""
        item.check_ready()
        if item.desc is None and item.data is None and item.file is None:
            raise OutputReleased(
                f"output {item.index} of job {item.job.id} was already streamed: npy outputs are sent once, straight "
                "from shared memory, and then released; fetch it once, or ask for png/webp/mp4 to keep an "
                "encoded copy")

    @asynccontextmanager
    async def _open_spilled(self, item: Item, data: bytes) -> AsyncIterator[OutputRead]:
        """A spilled npy, streamed as from its slot (header, then the rest) so the reader says when every
        byte went out: that was its one delivery, and the copy goes."""
        split = 10 + int.from_bytes(data[8:10], "little")  # npy 1.0: magic, version, header length, header
        read = OutputRead(data[:split], memoryview(data)[split:])
        try:
            yield read
        finally:
            if read.complete and item.data is data:
                item.data = None
                log.info("spilled output %s delivered; its copy dropped", item.request_id)

    def lease(self, item: Item) -> tuple[TensorDesc, int, int]:
        """Pin an npy output for a program on this machine that maps it: its descriptor, the fd
        of the sealed memory it lies in, and that memory's size. Counts as its one delivery: the
        slot goes back at ``unlease`` (the client dropped its arrays or hung up)."""
        item.check_ready()
        job = item.job
        if item.desc is None:
            if item.data is not None or item.file is not None:
                raise NotShared(f"output {item.index} of job {job.id} is not in shared memory (format "
                                f"{job.request.output_format}, or spilled); fetch it over HTTP")
            raise OutputReleased(f"output {item.index} of job {job.id} was already delivered once and released")
        assert item.worker is not None
        shared = item.worker.share(item.desc)
        if shared is None:
            raise NotShared("this kernel cannot seal shared memory against writes (Linux 5.1+), so outputs are "
                            "not handed out by fd; fetch them over HTTP")
        self._pin(item)
        return item.desc, *shared

    def unlease(self, item: Item) -> None:
        item.release_pending = True
        self._unpin(item)

    async def read_all(self, item: Item) -> bytes:
        """The whole output as bytes (the synchronous endpoint's base64); copies an npy once."""
        if item.data is not None:
            return item.data
        if item.desc is None and item.file is not None:
            return await self._read_file(item)
        header, payload = self._npy_parts(item)
        try:
            return header + bytes(payload)
        finally:
            payload.release()

    async def _read_file(self, item: Item) -> bytes:
        assert item.file is not None
        return await self.files.read(item.job.id, item.file, f"output {item.index}", item.nbytes)

    async def _write_file(self, item: Item, parts: list[bytes | memoryview]) -> bool:
        """Write an output's file; False (and the job failed) if it could not be written."""
        job = item.job
        ext = FORMATS[job.request.output_format].extension
        loop = asyncio.get_running_loop()
        written: list[str] = []
        try:
            name, size = await loop.run_in_executor(self.executor, self.store.write_output, job.id, item.index, ext,
                                                    parts)
            written.append(name)
            await self.trajectories.save(item)  # its arrays beside it (trajectory_files.py)
        except Exception as exc:
            await self._unwrite(item, written)
            code = exc.code if isinstance(exc, EngineError) else ErrorCode.OUTPUT_FAILED
            message = exc.message if isinstance(exc, EngineError) else f"writing the output file failed: {exc}"
            self._on_failed(item, message, Stage.ENCODING, code)
            return False
        if job.terminal:
            # cancelled or past its deadline while its files were written: its record, written when it ended,
            # lists none of them, so nothing would ever delete them
            await self._unwrite(item, written)
            return False
        item.file, item.nbytes = name, size  # only now: a record written from here on lists them
        return True

    async def _unwrite(self, item: Item, written: list[str]) -> None:
        """Remove the files of an output that will not be listed (its trajectory's too)."""
        names = written + [f["file"] for f in (item.trajectory_files or {}).values()]
        item.trajectory_files = None
        if names:
            await asyncio.get_running_loop().run_in_executor(self.executor, self.store.discard_outputs, names)

    async def _persist_npy(self, item: Item) -> None:
        header, payload = self._npy_parts(item)
        self._pin(item)
        try:
            written = await self._write_file(item, [header, payload])
        finally:
            payload.release()
            self._unpin(item)
        if written and not item.job.terminal:
            self._on_ready(item)
            assert item.worker is not None
            self.relieve(item.worker)

    def _npy_parts(self, item: Item) -> tuple[bytes, memoryview]:
        assert item.worker is not None and item.desc is not None
        desc = item.desc
        buf = item.worker.buffer(desc)
        return npy_header(numpy_dtype(desc.dtype), desc.shape), buf[desc.offset : desc.offset + desc.nbytes]

    # encoding -----------------------------------------------------------------------------------
    def _options(self, item: Item) -> EncodeOptions:
        track = sound.waveform(self.trajectories, item) if item.job.request.output_format == "mp4" else None
        return EncodeOptions(png_compress_level=self.png_compress_level, fps=item.job.request.fps,
                             metadata=file_metadata(item),
                             audio=None if track is None else (track, item.job.request.audio_rate))

    async def _encode(self, item: Item, fmt: str) -> None:
        assert item.worker is not None and item.desc is not None
        job = item.job
        try:  # the worker's memory (its sound track too): a failure fails the job, never leaves it encoding
            opts = self._options(item)
            array = as_numpy(item.worker.buffer(item.desc), item.desc)
        except Exception as exc:
            log.exception("reading the output of %s failed", item.request_id)
            self._on_failed(item, f"reading the output (and its sound track) out of the worker's memory to encode it "
                            f"as {fmt} failed: {exc}", Stage.ENCODING, ErrorCode.OUTPUT_FAILED)
            return
        self._pin(item)
        t0 = time.perf_counter()
        try:
            data = await asyncio.get_running_loop().run_in_executor(self.executor, encode, array, fmt, opts)
        except Exception as exc:
            log.exception("encoding %s of %s failed", fmt, item.request_id)
            self._on_failed(item, f"encoding the output as {fmt} failed: {exc}", Stage.ENCODING,
                            ErrorCode.OUTPUT_FAILED)
            return
        finally:
            del array
            self._unpin(item)
        ms = (time.perf_counter() - t0) * 1000
        job.add_timing("encode", ms)
        self.metrics.stage_seconds.labels("encode").observe(ms / 1000)
        self._free(item)  # the bytes are ours now; the slot goes back to the worker
        if job.terminal:
            return
        if self.store.persistent:
            if not await self._write_file(item, [data]) or job.terminal:
                return
        else:
            item.data = data
            item.nbytes = len(data)
        self._on_ready(item)

    # slot lifetime ------------------------------------------------------------------------------
    def _pin(self, item: Item) -> None:
        item.pins += 1

    def _unpin(self, item: Item) -> None:
        item.pins -= 1
        if item.pins == 0 and item.release_pending:
            item.release_pending = False
            self._free(item)

    def _free(self, item: Item) -> None:
        """Give the item's slot back to its worker, now or (while pinned) at the last unpin."""
        if item.desc is None:
            return
        if item.pins:
            item.release_pending = True
            return
        desc, item.desc = item.desc, None
        self._holding.discard(item)
        if item.worker is not None:
            item.worker.return_slot(desc)

    def relieve(self, worker: WorkerLink, need: int = 0, size: int = 0) -> None:
        """Spill the oldest unfetched npy outputs, then the oldest trajectories: while they hold over half of
        the worker's arena, or (``need`` > 0, the worker is waiting for a slot of ``size`` bytes) until ``need`` more
        bytes are free. A waiting worker needs them in one range: ``_room`` picks what to spill for that."""
        capacity = worker.arena_capacity
        if not capacity:
            return
        excess = worker.arena_held_bytes - capacity // 2  # a dedicated memfd holds no arena room
        room = self._room(worker, size) if need > 0 and size > 0 else None
        for item, side in room or ():
            excess -= self._spill_one(item, side)
        if need > 0 and room is None:
            excess = max(excess, need)
        for item in sorted(self._spillable(worker), key=lambda i: i.enqueued_at):
            if excess <= 0:
                break
            excess -= self._spill_one(item, side=False)
        for item in self.trajectories.spillable(worker):
            if excess <= 0:
                break
            excess -= self._spill_one(item, side=True)

    def _spillable(self, worker: WorkerLink) -> list[Item]:
        return [i for i in self._holding if i.worker is worker and i.desc is not None and not i.desc.dedicated
                and i.done and not i.pins and not i.spilling]

    def _spill_one(self, item: Item, side: bool) -> int:
        """Start giving back the item's output slot (``side``: its trajectory's region), marked as being spilled at
        once so that no later choice takes it again before its task starts; the bytes it frees."""
        if side:
            assert item.trajectory is not None
            self._keep(self.trajectories.spill(item))
            return item.trajectory.region.nbytes
        assert item.desc is not None
        nbytes = item.desc.nbytes
        if item.file is not None:  # already on disk: the slot can simply go back
            self._free(item)
        else:
            item.spilling = True
            self._keep(self._spill(item))
        return nbytes

    def _room(self, worker: WorkerLink, size: int) -> list[tuple[Item, bool]] | None:
        """What to spill so that one free range of ``size`` bytes opens in the worker's arena: the fewest bytes, the
        oldest among equals. The worker asks once, then waits for releases until --slot-timeout-s: spilled slots
        that do not join up with free room leave it waiting for nothing. None where the ranges held here cannot
        open one, or where one is open already as far as the engine knows (the worker holds slots it has not
        announced yet, this output's trajectory or a preview, or has not read releases on their way): then the
        bytes missing are all there is to go by. Empty where every range that looks open is only opening, through
        spills still under way: the worker asks again while it waits, and those spills are the room it asked for."""
        size = _taken(0, size)[1]  # as the arena reserves it
        outputs, sides = set(self._spillable(worker)), set(self.trajectories.spillable(worker))
        ranges = [(*_taken(d.offset, d.nbytes), (i, False) if i in outputs else None) for i in self._holding
                  if i.worker is worker and (d := i.desc) is not None and not d.dedicated
                  and not i.spilling]  # one being spilled frees its range by itself
        regions = self.trajectories.regions(worker)
        ranges += [(*_taken(r.offset, r.nbytes), (i, True) if i in sides else None) for i, r in regions]
        leaving = [_taken(d.offset, d.nbytes) for i in self._holding if i.worker is worker
                   and (d := i.desc) is not None and not d.dedicated and i.spilling]
        kept = {i for i, _ in regions}  # the worker's regions held here, less those being spilled
        leaving += [_taken(t.region.offset, t.region.nbytes) for i in self.trajectories.held if i.worker is worker
                    and (t := i.trajectory) is not None and i.trajectory_data is None and not t.region.dedicated
                    and i not in kept]
        best: tuple[int, float, int] | None = None
        chosen: list[tuple[Item, bool]] = []
        open_now = False  # a range free as far as the engine knows, with no spill under way in it
        for start in {0, *(hi for _, hi, _ in ranges)}:  # a cheapest range can start at 0 or where one ends
            inside = [(hi - lo, what) for lo, hi, what in ranges if lo < start + size and hi > start]
            if start + size > worker.arena_capacity or any(what is None for _, what in inside):
                continue
            if not inside and not any(lo < start + size and hi > start for lo, hi in leaving):
                open_now = True
            spilled = [what for _, what in inside if what is not None]
            key = (sum(n for n, _ in inside), max((i.enqueued_at for i, _ in spilled), default=0.0), start)
            if best is None or key < best:
                best, chosen = key, spilled
        if best is None or open_now:
            return None
        return chosen  # empty where spills under way open the range: nothing more to spill

    def _leave_stopped(self) -> None:
        """Copy what outputs hold in a stopped worker's arena out, so it is unmapped: each LTX-2 output's sound track
        holds a side region for its job's retention, and each stop and reload would leave another arena mapped,
        outside ``--host-memory`` (issue 30). At the next delivery (the reload's first output is one)."""
        for worker in {i.worker for i in (*self._holding, *self.trajectories.held) if i.worker is not None}:
            if worker.state == WorkerState.DEAD:
                self.relieve(worker, need=worker.arena_capacity)

    async def _spill(self, item: Item) -> None:
        """Copy an npy output out of the arena (``relieve`` chose it, and marked it ``spilling``)."""
        if item.desc is None:  # given back since it was chosen (a read, its job's end, the engine stopping)
            item.spilling = False
            return
        self._pin(item)
        try:
            header, payload = self._npy_parts(item)
            data = await asyncio.get_running_loop().run_in_executor(self.executor, _join, header, payload)
            payload.release()
            if not item.release_pending:  # else it was delivered (or its job ended) meanwhile: keep no copy
                item.data = data
        finally:
            self._unpin(item)
            item.spilling = False
        self._free(item)
        if item.data is data:
            log.info("spilled output %s (%d bytes) out of the arena", item.request_id, len(data))

    @staticmethod
    def memory_bytes(jobs: Iterable[Job]) -> int:
        """Output bytes held in the engine's own memory: encoded outputs (without a state dir) and what was
        spilled out of shared memory, outputs and trajectories (``/metrics`` ``diffusiond_output_memory_bytes``)."""
        return sum(len(i.data or b"") + len(i.trajectory_data or b"") for j in jobs for i in j.items)

    def _keep(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _taken(offset: int, nbytes: int) -> tuple[int, int]:
    """The arena range a slot of ``nbytes`` at ``offset`` reserves (``Arena`` rounds each up to ``ALIGN``)."""
    return offset, offset + -(-nbytes // ALIGN) * ALIGN


def _join(header: bytes, payload: memoryview) -> bytes:
    return header + payload.tobytes()
