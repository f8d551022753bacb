"""The copy thread: device output -> arena slot, off the compute thread's critical path.

For each finished batch it makes a side CUDA stream wait on the compute thread's event, converts
each request's output on the device (float [0, 1] NCHW -> uint8 NHWC: 4x fewer bytes to move),
copies it with ``non_blocking=True`` into its own slot of the registered arena, waits for its own
event, and only then announces OUTPUT_READY. The batch's device tensors stay referenced until
their copies are done, so the caching allocator cannot hand their memory to the next forward.

On CPU the same code runs with plain copies. In ``sync`` output mode the compute thread calls
``process`` itself before its next forward (the "async off" baseline).

Previews take another road (``worker/previews.py``): the compute thread queues their copies
itself, and this thread only finishes the few still in flight when a forward ends.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from diffusiond.ipc.arena import Arena, DedicatedBuffer, Slot
from diffusiond.ipc.errors import ArenaFull, SlotTooLarge
from diffusiond.ipc.messages import (
    BatchParams,
    EndStatus,
    OutputReady,
    RequestEnded,
    RequestSpec,
    SlotWait,
)
from diffusiond.ipc.sidearrays import TrajectoryDesc
from diffusiond.ipc.tensors import TensorDesc, describe, nbytes_of, write_tensor
from diffusiond.protocol import AUDIO_ARRAY, SIDE_ARRAYS
from diffusiond.worker.previews import PendingPreview, PreviewOutbox
from diffusiond.worker.startup import bind_thread
from diffusiond.worker.state import SharedState

ASK_AGAIN_S = 1.0  # how often a copy waiting for arena room asks the engine again (``_slot``)

log = logging.getLogger(__name__)

Post = Callable[..., None]  # Channel.post_threadsafe

@dataclass
class CopyJob:
    batch_id: int
    params: BatchParams
    requests: list[RequestSpec]
    outputs: list[torch.Tensor]
    event: torch.cuda.Event | None  # recorded after the forward; None on CPU
    # each request's side arrays on the device: its trajectory (pipelines/trajectories.py), when the batch
    # asked, and its sound track (pipelines/ltx2.py), when the request wants it; {} for neither
    trajectories: list[dict[str, torch.Tensor]] | None = None


def to_uint8(picture: torch.Tensor) -> torch.Tensor:
    """A float picture in [0, 1] as its 256 levels, on its device, in any layout: in float32 whatever its
    dtype, rounded as diffusers' numpy path rounds ((x * 255).round()), so outputs match what a user of the
    bare pipeline would get. The one rounding of the torch path, for the copy and for an upscaled output
    made uint8 before it (worker/finish.py)."""
    return (picture.float().clamp(0, 1) * 255).round().to(torch.uint8)


def to_output_layout(out: torch.Tensor, output_dtype: str) -> torch.Tensor:
    """Channels-last and the wire dtype, computed on the output's device. A float picture in [0, 1], or
    for a uint8 output one already at its 256 levels (``to_uint8``), which only changes layout."""
    if out.dtype == torch.uint8 and output_dtype != "uint8":
        raise ValueError(f"a uint8 picture cannot be sent as {output_dtype}: its levels are rounded already")
    if out.device.type == "cpu":
        return torch.from_numpy(_output_layout_numpy(out, output_dtype))
    x = out.permute(1, 2, 0) if out.dim() == 3 else out.permute(0, 2, 3, 1)
    if output_dtype == "uint8":
        return (x if x.dtype == torch.uint8 else to_uint8(x)).contiguous()
    return x.float().to(getattr(torch, output_dtype)).contiguous()


def _output_layout_numpy(out: torch.Tensor, output_dtype: str) -> np.ndarray:
    """The CPU path of ``to_output_layout``, in numpy, bit for bit the same result.

    Not torch, because of OpenMP: a torch op large enough to run in parallel on this thread would
    give the copy thread its own OpenMP team, and with two teams on the cores libgomp throttles
    every team's spin-waiting, so the forward's many short parallel regions pay a wake-up each.
    Measured on the 2-core box: the tiny model's forward took 135 ms in async mode against 77 ms
    in sync mode (docs/benchmarks.md). numpy's element-wise work is single-threaded.
    """
    if out.dtype == torch.uint8:  # already its levels: the layout only
        a = out.numpy()
        return np.ascontiguousarray(a.transpose(1, 2, 0) if a.ndim == 3 else a.transpose(0, 2, 3, 1))
    a = _float32(out)
    a = a.transpose(1, 2, 0) if a.ndim == 3 else a.transpose(0, 2, 3, 1)
    if output_dtype == "uint8":
        x = np.clip(a, 0, 1, out=np.empty(a.shape, np.float32))  # C order, like the torch path
        x *= np.float32(255)
        return np.rint(x, out=x).astype(np.uint8)
    return np.ascontiguousarray(a, dtype=np.dtype(output_dtype))


def _float32(out: torch.Tensor) -> np.ndarray:
    """A CPU float picture in numpy's float32, without a parallel torch op (``_output_layout_numpy`` says why)."""
    if out.dtype == torch.bfloat16:  # numpy has no bfloat16: widen the bits to float32 ones
        return (out.view(torch.int16).numpy().view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if out.dtype in (torch.float16, torch.float32, torch.float64):
        return out.numpy().astype(np.float32, copy=False)
    return out.float().numpy()


def finite(tensors: Sequence[torch.Tensor]) -> list[bool]:
    """Whether each tensor holds only finite numbers. The cast to uint8 would turn NaN into black pixels and
    the job would succeed with them; a scheduler dividing by zero over too few steps, or a half-precision
    overflow, must fail its job with the reason instead. Each tensor's smallest and largest value
    are enough (both are NaN when one element is, one of them inf when one is), so nothing as large as an
    output is allocated, on a device where memory was never counted for it, and a device's answers
    are read back once, waiting on a blocking event rather than spinning (``Copier._sync`` says why)."""
    flags = [True] * len(tensors)
    ends: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    for k, t in enumerate(tensors):
        if t.dtype == torch.uint8 or t.numel() == 0:  # levels are finite
            continue
        if t.device.type == "cpu":  # numpy, not a parallel torch op (``_output_layout_numpy`` says why)
            a = _float32(t) if t.dtype == torch.bfloat16 else t.numpy()
            flags[k] = bool(np.isfinite(a.min()) and np.isfinite(a.max()))
        else:
            ends.setdefault(t.device, []).append((k, torch.stack([t.amin().float(), t.amax().float()])))
    for device, pairs in ends.items():
        found = torch.stack([pair for _, pair in pairs]).isfinite().all(dim=1).to("cpu", non_blocking=True)
        done = torch.cuda.Event(blocking=True)
        done.record(torch.cuda.current_stream(device))
        done.synchronize()
        for (k, _), ok in zip(pairs, found.tolist(), strict=True):
            flags[k] = ok
    return flags


def finite_or_assumed(tensors: Sequence[torch.Tensor],
                      check: Callable[[Sequence[torch.Tensor]], list[bool]] = finite) -> list[bool]:
    """``check``'s answer; when the check itself fails (a device error, a bug), the tensors taken as finite
    after logging why: a check that cannot run must not cost the job, nor the copy thread."""
    try:
        return check(tensors)
    except Exception:
        log.exception("could not check %d outputs for NaN or inf; taking them as finite", len(tensors))
        return [True] * len(tensors)


def sound_of(arrays: dict[str, torch.Tensor] | None) -> torch.Tensor | None:
    """A request's sound track among its side arrays (LTX-2's), checked for NaN as its picture is."""
    return arrays.get(AUDIO_ARRAY) if arrays else None


NOT_FINITE = ("its output is not finite (NaN or inf), so it has no picture to give: too few steps for its scheduler, "
              "or a float16 overflow (serve it with --dtype bfloat16 or float32)")


class Copier:
    def __init__(
        self,
        arena: Arena,
        state: SharedState,
        post: Post,
        *,
        device: torch.device,
        slot_timeout_s: float,
    ) -> None:
        self.arena = arena
        self.state = state
        self.post = post
        self.device = device
        self.slot_timeout_s = slot_timeout_s
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device=device) if self.cuda else None
        self.dedicated: dict[int, int] = {}  # slot id -> bytes, until the engine releases it
        self._next_dedicated = 1 << 40  # ids that can never collide with arena slot ids
        self._lock = threading.Lock()
        self.previews = PreviewOutbox(arena, state, post, cuda=self.cuda)
        self.queue: queue.Queue[CopyJob | PendingPreview] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="copy", daemon=True)
        self._bound = threading.Event()
        self._unbound: BaseException | None = None

    def start(self) -> None:
        """Start the copy thread, once it is bound to the worker's device: a device that cannot be made current
        there (fallen off the bus, reset) fails the worker's start with the reason, where a thread dying alone
        would leave every output copy waiting."""
        self.thread.start()
        self._bound.wait()
        if self._unbound is not None:
            raise RuntimeError(f"the copy thread could not use {self.device}: {self._unbound}") from self._unbound

    def submit(self, job: CopyJob | PendingPreview) -> None:
        self.state.copy_queued()
        self.queue.put(job)

    def submit_previews(self) -> None:
        """After a forward: the previews whose copies are still in flight, ahead of its outputs."""
        for preview in self.previews.take_pending():
            self.submit(preview)

    def _run(self) -> None:
        try:
            if self.cuda:
                bind_thread(self.device)  # as the compute thread does
        except BaseException as exc:
            self._unbound = exc
            return
        finally:
            self._bound.set()
        while True:  # a daemon thread: it ends with the process
            job = self.queue.get()
            try:
                if isinstance(job, PendingPreview):
                    self.previews.finish(job)
                else:
                    self.process(job)
            except Exception:  # never the end of this thread: every later batch of the worker would wait on it
                log.exception("the copy thread's job failed")
            finally:
                self.state.copy_done()

    def process(self, job: CopyJob) -> None:
        """Copy a batch's outputs. A failure of one copy fails that request alone (``_copy_one``); any other
        failure fails the batch's requests not yet answered, with the reason, rather than leaving them to
        wait for their timeout."""
        try:
            self._process(job)
        except Exception as exc:
            log.exception("copying batch %d failed", job.batch_id)
            for req in job.requests:
                if self.state.holds(req.request_id):
                    self._end(job, req, "failed", f"copy failed: {type(exc).__name__}: {exc}")
            job.outputs.clear()
            job.trajectories = None

    def _finite(self, tensors: Sequence[torch.Tensor]) -> list[bool]:
        return finite(tensors)

    def _process(self, job: CopyJob) -> None:
        self.state.record("copy_start", job.batch_id)
        if self.stream is not None and job.event is not None:
            self.stream.wait_event(job.event)
            self.state.record_gpu("copy_start", job.batch_id, self.stream)
        trajectories: list[dict[str, torch.Tensor] | None] = list(job.trajectories or [])
        trajectories += [None] * (len(job.outputs) - len(trajectories))
        ctx = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        tracks = [sound_of(arrays) for arrays in trajectories]
        with ctx, torch.inference_mode():  # the pictures and the sound tracks in one read back
            flags = finite_or_assumed([*job.outputs, *(t for t in tracks if t is not None)], self._finite)
        heard = iter(flags[len(job.outputs):])
        whole = [(track is None or next(heard)) and ok for ok, track in zip(flags[:len(tracks)], tracks, strict=True)]
        for req, out, arrays, ok in zip(job.requests, job.outputs, trajectories, whole, strict=True):
            if ok:
                self._copy_one(job, req, out, arrays)
            elif self.state.is_cancelled(req.request_id):
                self._end(job, req, "cancelled", "cancelled before its output was copied")
            else:
                self._end(job, req, "failed", NOT_FINITE, "computing")
        if self.stream is not None:
            self.state.record_gpu("copy_end", job.batch_id, self.stream)
        job.outputs.clear()  # the last references to the batch's device memory
        job.trajectories = None
        self.state.record("copy_end", job.batch_id)

    def _copy_one(self, job: CopyJob, req: RequestSpec, out: torch.Tensor,
                  arrays: dict[str, torch.Tensor] | None) -> None:
        if self.state.is_cancelled(req.request_id):
            self._end(job, req, "cancelled", "cancelled before its output was copied")
            return
        traj: tuple[TrajectoryDesc, int | None] | None = None
        try:
            if arrays:
                traj = self._copy_trajectory(arrays, req.request_id)
            desc, fd = self._copy(job, out, req.request_id)
        except Exception as exc:
            if traj is not None:  # nobody knows its slot yet: back now
                self._forget(*traj)
            if isinstance(exc, ArenaFull):
                self._end(job, req, "failed", str(exc))
                return
            log.exception("copy of %s failed", req.request_id)
            self._end(job, req, "failed", f"copy failed: {type(exc).__name__}: {exc}")
            return
        self.state.finish(req.request_id)
        msg = OutputReady(request_id=req.request_id, batch_id=job.batch_id, tensor=desc,
                          trajectory=traj[0] if traj is not None else None)
        fds = [f for f in (fd, traj[1] if traj is not None else None) if f is not None]
        if fds:
            self.post(msg, fds, close_fds=True)
        else:
            self.post(msg)

    def _copy_trajectory(self, arrays: dict[str, torch.Tensor],
                         request_id: str) -> tuple[TrajectoryDesc, int | None]:
        """Every side array of one request (trajectory, sound track) into one region (an arena slot, or a
        dedicated memfd when it is larger than the arena), each at a 64-byte boundary, in SIDE_ARRAYS' order."""
        layout: list[tuple[str, torch.Tensor, int]] = []
        total = 0
        for name in SIDE_ARRAYS:
            if name in arrays:
                layout.append((name, arrays[name], total))
                total += (nbytes_of(arrays[name]) + 63) // 64 * 64
        ctx = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        with ctx, torch.inference_mode():
            try:
                slot = self._slot(total, request_id)
            except SlotTooLarge:
                slot = None
            dedicated = DedicatedBuffer(total, name="diffusiond-trajectory") if slot is None else None
            buf = dedicated.buffer() if dedicated is not None else self.arena.buffer(slot)  # type: ignore[arg-type]
            try:
                try:
                    for _name, tensor, off in layout:
                        write_tensor(buf[off:], tensor, non_blocking=self.cuda)
                    self._sync()
                finally:
                    buf.release()  # a memfd's mapping cannot close under a live view
            except BaseException:
                if dedicated is not None:
                    dedicated.unmap()
                    os.close(dedicated.fd)
                elif slot is not None:
                    self.arena.release(slot.id)
                raise
        if dedicated is not None:
            dedicated.unmap()
            with self._lock:
                slot_id = self._next_dedicated
                self._next_dedicated += 1
                self.dedicated[slot_id] = total
            base, fd = 0, dedicated.fd
        else:
            assert slot is not None
            slot_id, base, fd = slot.id, slot.offset, None
        region = TensorDesc(dtype="uint8", shape=(total,), nbytes=total, slot_id=slot_id, offset=base,
                            dedicated=fd is not None)
        descs = {name: describe(tensor, slot_id, base + off, dedicated=fd is not None) for name, tensor, off in layout}
        return TrajectoryDesc(region=region, arrays=descs), fd

    def _forget(self, desc: TrajectoryDesc, fd: int | None) -> None:
        """A trajectory whose output could not be copied: its memory goes back at once."""
        self.release(desc.region.slot_id)
        if fd is not None:
            os.close(fd)

    def _copy(self, job: CopyJob, out: torch.Tensor, request_id: str) -> tuple[TensorDesc, int | None]:
        ctx = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        with ctx, torch.inference_mode():
            host = to_output_layout(out, job.params.output_dtype)
            nbytes = nbytes_of(host)
            try:
                slot = self._slot(nbytes, request_id)
            except SlotTooLarge:
                return self._copy_dedicated(host, nbytes)
            self._fill(slot, host)
            return describe(host, slot.id, slot.offset), None

    def _slot(self, nbytes: int, request_id: str) -> Slot:
        """An arena slot, waiting (bounded by ``slot_timeout_s``) for the engine to give some back. ``SlotWait``
        reports as in use what this request cannot use: all but the largest free range, since free room in pieces
        each too small is no room. It is sent again every ``ASK_AGAIN_S`` while the wait lasts: what the engine
        spilled for the first may free bytes that do not join up with the free range, and the engine, which sees
        only the slots announced to it, learns what is still missing only when asked again."""
        slot = self.arena.try_allocate(nbytes)
        deadline = time.monotonic() + self.slot_timeout_s
        while slot is None:
            self.post(SlotWait(request_id, nbytes, self.arena.capacity - self.arena.largest_free, self.arena.capacity))
            remaining = deadline - time.monotonic()
            try:
                slot = self.arena.allocate(nbytes, timeout=max(0.0, min(ASK_AGAIN_S, remaining)))
            except ArenaFull:
                if remaining <= ASK_AGAIN_S:
                    raise ArenaFull(self.arena.full(nbytes, self.slot_timeout_s)) from None
        return slot

    def _copy_dedicated(self, host: torch.Tensor, nbytes: int) -> tuple[TensorDesc, int]:
        buf = DedicatedBuffer(nbytes)
        try:
            write_tensor(buf.buffer(), host, non_blocking=self.cuda)
            self._sync()
        except BaseException:
            buf.unmap()
            os.close(buf.fd)
            raise
        buf.unmap()  # the fd keeps the memory; the channel closes it once sent
        with self._lock:
            slot_id = self._next_dedicated
            self._next_dedicated += 1
            self.dedicated[slot_id] = nbytes
        return describe(host, slot_id, 0, dedicated=True), buf.fd

    def _fill(self, slot: Slot, host: torch.Tensor) -> None:
        """Copy ``host`` into its arena slot and wait for it; a failed copy gives the slot back
        (outputs and previews alike: nobody else knows the slot yet)."""
        try:
            write_tensor(self.arena.buffer(slot), host, non_blocking=self.cuda)
            self._sync()
        except BaseException:
            self.arena.release(slot.id)
            raise

    def _sync(self) -> None:
        """Wait for this thread's copies, sleeping rather than spinning.

        A default CUDA event spins in the driver while it waits, and this wait overlaps the next
        forward, whose kernel launches on the compute thread go through the same driver.
        """
        if self.stream is not None:
            done = torch.cuda.Event(blocking=True)
            done.record(self.stream)
            done.synchronize()

    def release(self, slot_id: int) -> None:
        with self._lock:
            if self.dedicated.pop(slot_id, None) is not None:
                return
        if not self.previews.release(slot_id):
            self.arena.release(slot_id)

    @property
    def dedicated_bytes(self) -> int:
        with self._lock:
            return sum(self.dedicated.values())

    def _end(self, job: CopyJob, req: RequestSpec, status: EndStatus, message: str, stage: str = "copying") -> None:
        self.state.finish(req.request_id)
        self.post(RequestEnded(req.request_id, job.batch_id, status, message, stage))

