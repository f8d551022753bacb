"""How a whole component's update gets from the client's memfd into the parameters on the device (issue 29).

The memfd's pages are ordinary shared memory, so a plain ``copy_`` to CUDA is a pageable copy: the driver stages
it through a small buffer of its own, one tensor at a time, and waits for each. Here the CPU copies the mapping
into two pinned buffers of ``_STAGE`` bytes in turn (torch's copy runs on its math threads) while the GPU's copy
engine empties the other. Measured on an H100 host for the SDXL UNet's 4.9 GB (docs/benchmarks.md, 2026-12-06,
``scripts/gpu_round3.sh weights``): 0.22 s staged, 0.57 s pageable, and 0.37 s with the whole mapping page-locked
in place (``cudaHostRegister``, which walks every page of every update; dropped for that).

``DIFFUSIOND_UPDATE_COPY=pageable`` is the benchmark's switch for that comparison, not a setting. Small updates
(under ``_FROM``), other dtypes (converted as they are copied) and destinations off CUDA copy directly.
"""

from __future__ import annotations

import os

import torch

STAGED = os.environ.get("DIFFUSIOND_UPDATE_COPY", "staged") != "pageable"
_FROM = 64 << 20  # below this, the two buffers' allocation costs about what staging saves
_STAGE = 64 << 20


def copy_into(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Each source's values into its destination (same shapes, checked by the caller); every copy is done when
    this returns, so the sources' mapping may go."""
    staged = [(d, s) for d, s in pairs if STAGED and _stageable(d, s)]
    if sum(s.nbytes for _, s in staged) < _FROM:
        staged = []
    chosen = {id(d) for d, _ in staged}
    with torch.no_grad():
        for dst, src in pairs:
            if id(dst) not in chosen:
                dst.copy_(src)
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
    stream.synchronize()  # the buffers and the sources' mapping go when this returns
