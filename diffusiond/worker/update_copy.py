"""How a whole component's update gets from the client's memfd into the parameters on the device (issue 29).

The memfd's pages are ordinary shared memory, so a plain ``copy_`` to CUDA is a pageable copy: the driver stages
it through a small buffer of its own, one tensor at a time, synchronously (the SDXL UNet's 4.8 GB took 3.6 s in all
on an H100 host). Two ways around that, compared by ``scripts/bench_live.py`` in one device call (the
``DIFFUSIOND_UPDATE_COPY`` switch is the benchmark's, not a setting; the faster becomes the only one):

- ``pinned``: the mapping itself is page-locked (``cudaHostRegister``, read-only) and every tensor is one DMA,
  queued without waiting; the pinning walks every page once.
- ``staged``: the CPU copies the mapping into two pinned buffers of ``_STAGE`` bytes in turn (torch's copy runs on
  its math threads) while the GPU's copy engine empties the other; nothing is pinned per update.

Small updates (under ``_FROM``) and destinations off CUDA copy directly: neither way pays for itself there.
"""

from __future__ import annotations

import logging
import mmap
import os

import numpy as np
import torch

from diffusiond.ipc import cuda_host

log = logging.getLogger("diffusiond.worker")

MODE = os.environ.get("DIFFUSIOND_UPDATE_COPY", "pinned")  # pinned | staged | pageable
_FROM = 64 << 20
_STAGE = 64 << 20


def wants_pin(size: int) -> bool:
    return MODE == "pinned" and size >= _FROM and torch.cuda.is_initialized()


def pin(mm: mmap.mmap, size: int) -> int:
    """The mapping's address, pinned for CUDA; 0 where the driver refused (the copies are then pageable)."""
    address = int(np.frombuffer(mm, dtype=np.uint8).ctypes.data)
    try:
        cuda_host.register(address, size, read_only=True)
    except RuntimeError as exc:
        log.warning("an update's %d MB could not be pinned (%s); copied from pageable memory", size >> 20, exc)
        return 0
    return address


def unpin(address: int, size: int) -> None:
    torch.cuda.synchronize()  # no copy may still read the pages when they are unpinned
    cuda_host.unregister(address, size)


def copy_into(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Each source's values into its destination (same shapes, checked by the caller); returns with every copy
    done or, from a pinned mapping, queued (``unpin`` waits for those)."""
    staged = [(d, s) for d, s in pairs if MODE == "staged" and _stageable(d, s)]
    if sum(s.nbytes for _, s in staged) < _FROM:
        staged = []
    chosen = {id(d) for d, _ in staged}
    with torch.no_grad():
        for dst, src in pairs:
            if id(dst) not in chosen:
                dst.copy_(src, non_blocking=True)
        if staged:
            _staged(staged)


def _stageable(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Bytes can go as they are: same dtype, both contiguous, the destination on CUDA."""
    return dst.is_cuda and dst.dtype == src.dtype and dst.is_contiguous() and src.is_contiguous()


def _staged(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    stream = torch.cuda.current_stream()
    bufs = [torch.empty(_STAGE, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    emptied: list[torch.cuda.Event | None] = [None, None]
    k, used = 0, 0
    pending: list[tuple[torch.Tensor, int, int]] = []

    def flush() -> None:
        nonlocal k, used, pending
        for dst, a, b in pending:
            dst.copy_(bufs[k][a:b], non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
        emptied[k], k, used, pending = event, k ^ 1, 0, []
        reading = emptied[k]
        if reading is not None:
            reading.synchronize()  # the GPU is done reading the buffer the CPU fills next

    for dst, src in pairs:
        d, s = dst.reshape(-1).view(torch.uint8), src.reshape(-1).view(torch.uint8)
        for start in range(0, s.numel(), _STAGE):
            piece = s[start:start + _STAGE]
            if used + piece.numel() > _STAGE:
                flush()
            bufs[k][used:used + piece.numel()].copy_(piece)
            pending.append((d[start:start + piece.numel()], used, used + piece.numel()))
            used += piece.numel()
    if pending:
        flush()
    stream.synchronize()
