"""How a live update's values get into the parameters (issue 29): a whole component's from the client's memfds
(``copy_into``), a loaded LoRA's from the host tensors the worker keeps (``copy_tensors``, plain copies).

The bytes are read with ``preadv`` straight from the memfds (sealed against writes and shrinking: the engine
checks, ``ipc/updates.SEALS``), never mapped: populating a mapping of the SDXL UNet's 4.9 GB took 0.45-0.5 s on an
H200 host before a byte was copied (its page tables, 1.2 million entries), and the copy out of the mapping was
the CPU's memcpy again. A read is the kernel's one copy, and reads of one memfd take no lock, so threads share it.

- A parameter on the CPU, contiguous and of the dtype sent, is read into in place: one copy in all.
- One on CUDA goes through two pinned buffers of ``_STAGE`` bytes, kept for the worker's life: a pool of threads
  reads the next buffer's pieces side by side while the GPU's copy engine empties the other. A plain ``copy_``
  from pageable memory is the driver's own staging, one tensor at a time and waited for (0.57 s against 0.22 s
  for the staged copy out of a mapping on an H100 host, docs/benchmarks.md 2026-12-06).
- Anything else (another dtype, converted as it is copied; a strided destination) is read into an array, then
  copied.

``DIFFUSIOND_UPDATE_COPY=pageable`` is the benchmark's switch (every CUDA destination the third way), not a
setting. Small updates (under ``_FROM``) skip the staging buffers too.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np
import torch

from diffusiond.ipc.messages import WeightTensor
from diffusiond.ipc.tensors import dtype_name, nbytes, numpy_dtype
from diffusiond.pipelines.errors import HalfApplied

log = logging.getLogger(__name__)

STAGED = os.environ.get("DIFFUSIOND_UPDATE_COPY", "staged") != "pageable"
_FROM = 64 << 20  # below this, filling the buffers costs about what staging saves
_STAGE = 64 << 20
_READ = 8 << 20  # the most one thread reads at a time: a buffer's 64 MiB is read by up to 8 threads at once
_THREADS = max(1, min(8, os.cpu_count() or 1))


class Source(NamedTuple):
    """Where one tensor of an update lies: its part's fd and the header's entry."""

    fd: int
    tensor: WeightTensor

    @property
    def nbytes(self) -> int:
        return nbytes(self.tensor.dtype, self.tensor.shape)


class _Written:
    """Whether a byte reached a destination yet: a failure before is a plain refusal, which changed nothing (a
    memfd the worker cannot read, a staging buffer's first fill), not a worker's exit."""

    began = False


def copy_into(pairs: list[tuple[torch.Tensor, Source]]) -> None:
    """Each source's values into its destination (shapes checked by the caller); every copy is done when this
    returns, so the fds may close. What can fail without writing fails first (the staging buffers, the reads of
    values to convert); a failure once writing began is ``HalfApplied``."""
    direct, staged, other = [], [], []
    for dst, src in pairs:
        same = dtype_name(dst) == src.tensor.dtype and dst.is_contiguous()
        if same and dst.device.type == "cpu":
            direct.append((dst, src))
        elif same and dst.is_cuda and STAGED:
            staged.append((dst, src))
        else:
            other.append((dst, src))
    if not _worth_staging(staged, sum(src.nbytes for _, src in staged), _FROM):
        other, staged = other + staged, []
    converted = [(dst, read_array(src.fd, src.tensor)) for dst, src in other]
    written = _Written()
    # the pool is shut down (every read done) before ``_writing`` asks whether one wrote
    with torch.no_grad(), _writing(written), ThreadPoolExecutor(_THREADS, thread_name_prefix="diffusiond-update") \
            as pool:
        reads = [pool.submit(_read_into, _bytes_of(dst), src.fd, src.tensor.offset, src.tensor.name, written)
                 for dst, src in direct]
        for dst, value in converted:
            written.began = True  # a copy_ that fails may have written part of it
            dst.copy_(value)
        if staged:
            _staged(staged, pool, written)
        for read in reads:
            read.result()


def _worth_staging(staged: Sequence[tuple[torch.Tensor, object]], nbytes: int, floor: int) -> bool:
    """Whether the CUDA destinations ``staged`` (``nbytes`` in all) go through the pinned buffers: enough bytes,
    and buffers to be had."""
    return bool(staged) and nbytes >= floor and len(_pinned(staged[0][0].device)) == 2


@contextlib.contextmanager
def _writing(written: _Written) -> Iterator[None]:
    """Around the writes: a failure once one began is ``HalfApplied``; one before is raised as it is."""
    try:
        yield
    except Exception as exc:
        if not written.began:
            raise
        raise HalfApplied(f"{type(exc).__name__}: {exc}") from exc


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A writable view of a contiguous CPU tensor's bytes (a parameter's storage, written in place)."""
    return t.detach().reshape(-1).view(torch.uint8).numpy().data


def _read_into(into: memoryview, fd: int, at: int, name: str, written: _Written | None = None) -> None:
    """``written``: ``into`` is a destination's own bytes, so a read that returned any changed it."""
    done = 0
    while done < len(into):  # a read may return less than asked
        got = os.preadv(fd, [into[done:]], at + done)
        if got and written is not None:
            written.began = True
        if got == 0:  # the engine refuses unsealed memfds; a caller that skipped it gets this
            raise ValueError(f"tensor {name!r} ends past the end of the update's memfd, which shrank after it was "
                             "sent; seal the memfd and send the update again")
        done += got


def read_array(fd: int, t: WeightTensor) -> torch.Tensor:
    """Tensor ``t`` of an update, read out of its part ``fd`` into memory of its own."""
    arr = np.empty(t.shape, dtype=numpy_dtype(t.dtype))
    _read_into(arr.reshape(-1).view(np.uint8).data, fd, t.offset, t.name)
    tensor = torch.from_numpy(arr)
    return tensor.view(torch.bfloat16) if t.dtype == "bfloat16" else tensor


_buffers: list[torch.Tensor] = []
_buffers_lock = threading.Lock()


def _pinned(device: torch.device) -> list[torch.Tensor]:
    """The two staging buffers (made on ``device``'s context at the first staged update and kept: pinning 128 MiB
    costs about what copying it does, every update; host memory residency does not count), or none where pinning
    fails, for the plain copies instead."""
    with _buffers_lock:
        if not _buffers:
            made: list[torch.Tensor] = []  # both or none: ``_staged`` alternates between two
            try:
                with torch.cuda.device(device):
                    for _ in range(2):
                        made.append(torch.empty(_STAGE, dtype=torch.uint8, pin_memory=True))
            except RuntimeError as exc:
                log.warning("no pinned staging buffers: buffer %d of 2 (%d MiB) could not be page-locked (%s); "
                            "this update copies pageable, the next tries again", len(made) + 1, _STAGE >> 20, exc)
            else:
                _buffers.extend(made)
        return _buffers


class _Piece(NamedTuple):
    """Up to a buffer's worth of one tensor: where it goes on the device, its span of the buffer, and where its
    bytes come from (its update's part, at ``at``)."""

    dst: torch.Tensor
    a: int
    b: int
    src: Source
    at: int

    def fill(self, view: memoryview, s: int, n: int) -> None:
        """Bytes ``s`` to ``s + n`` of the piece into the buffer."""
        _read_into(view[self.a + s:self.a + s + n], self.src.fd, self.at + s, self.src.tensor.name)


def copy_tensors(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Host tensors into their destinations (same shapes): a loaded live LoRA's. Plain copies: staged through the
    pinned buffers, a rank-64 FLUX adapter's 532 tensors applied in 44-48 ms against 44-55 ms (an H100 host,
    docs/benchmarks.md 2026-12-06, fourth session), the copies were never the cost. A failure once one began is
    ``HalfApplied``."""
    written = _Written()
    with torch.no_grad(), _writing(written):
        for dst, src in pairs:
            written.began = True
            dst.copy_(src)


def _staged(pairs: Sequence[tuple[torch.Tensor, Source]], pool: ThreadPoolExecutor, written: _Written) -> None:
    """Fill one buffer (its pieces side by side, ``_READ`` bytes a task), queue its copies to the device, fill the
    other while they run; a buffer is filled again only once the GPU has read it."""
    device = pairs[0][0].device  # one component's, on one device
    stream = torch.cuda.current_stream(device)
    bufs = _pinned(device)
    views = [b.numpy().data for b in bufs]
    emptied: list[torch.cuda.Event | None] = [None, None]
    k, used = 0, 0
    pending: list[_Piece] = []

    def flush() -> None:
        nonlocal k, used, pending
        waiting = emptied[k]
        if waiting is not None:
            waiting.synchronize()  # the GPU is done reading the buffer filled now
        tasks = [pool.submit(p.fill, views[k], s, min(_READ, p.b - p.a - s))
                 for p in pending for s in range(0, p.b - p.a, _READ)]
        for task in tasks:
            task.result()
        written.began = True  # the fills only wrote the buffer; these copies write the destinations
        for p in pending:
            p.dst.copy_(bufs[k][p.a:p.b], non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)  # made on the stream's device
        emptied[k], k, used, pending = event, k ^ 1, 0, []

    for dst, src in pairs:
        d = dst.reshape(-1).view(torch.uint8)
        for start in range(0, src.nbytes, _STAGE):
            size = min(_STAGE, src.nbytes - start)
            if used + size > _STAGE:
                flush()
            pending.append(_Piece(d[start:start + size], used, used + size, src, src.tensor.offset + start))
            used += size
    if pending:
        flush()
    stream.synchronize()  # the buffers are free for the next update, and the parameters hold the new values
