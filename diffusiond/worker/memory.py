"""A batch's working memory, measured around its forward: what it needed above what was there before.

Residency plans a run as the model's weights plus its working memory for the shape, and until a shape
has run it can only guess (``daemon/residency/working.py``, generous on purpose). The worker is the
one place that sees the memory a forward really takes, so it measures each batch and reports the figure
with the batch's COMPUTE_DONE; the engine remembers it in the state dir.

How, by device:

- CUDA: the caching allocator's own counters. ``reset_peak_memory_stats`` before the forward,
  ``max_memory_allocated`` after it, minus ``memory_allocated`` before it: the bytes of tensors the
  forward had alive at its peak beyond the weights and whatever else was held. Exact for what torch
  allocates; the allocator's cached-but-free blocks and cuDNN/cuBLAS workspaces outside it are not
  counted, and the allocator is per device, so a copy on the copy thread at the same time is counted
  with it (larger, never smaller).
- CPU: the process's peak resident memory. The kernel's high-water mark (VmHWM) is reset before the
  forward (``/proc/self/clear_refs``, writing 5) after glibc has given its free heap back to the system
  (``malloc_trim``), so freed memory kept by the allocator does not hide what the forward takes. After
  the forward the heap is trimmed again and the figure is the high-water mark above what is still
  resident then, plus the outputs' bytes: the memory the forward needed for a while. Pages that stay
  resident for good (library code and one-time buffers its first run faults in) are the worker's cost,
  not the shape's, and are left out. It counts every thread of the process, so a copy running beside
  the forward moves it a little either way. Both steps cost microseconds. Where either is missing
  (no /proc, a libc without ``malloc_trim``) nothing is reported rather than a figure that would be wrong.
- Other devices, and a model with offloading (``offload=model|group|sequential``): nothing is reported;
  residency keeps its conservative estimate. An offloaded model moves weights onto the device inside its
  forward, so the allocator's peak mixes them with the working memory, and residency already counts
  the weights the offload keeps there (``pipelines/offload.py``): reported, they would count twice.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
from collections.abc import Callable, Sequence

import torch

log = logging.getLogger(__name__)

_CLEAR_REFS = "/proc/self/clear_refs"
_STATUS = "/proc/self/status"
_RESET_HIGH_WATER = "5"  # clear_refs: reset the peak resident set size to the current one (Linux 4.0+)


class PeakMeter:
    """``start()`` before a forward, ``stop(outputs)`` after it: its working bytes, or None."""

    def __init__(self, device: torch.device, *, offloaded: bool = False) -> None:
        self.device = device
        self._base = 0
        self._started = False
        self._trim = _malloc_trim() if device.type == "cpu" else None
        measurable = device.type == "cuda" or (self._trim is not None and _can_reset())
        self.available = measurable and not offloaded
        self.forced: int | None = None  # the test fault ``working_bytes=N``: every batch says N (worker/faults.py)

    def start(self) -> None:
        self._started = False
        if not self.available:
            return
        try:
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
                self._base = torch.cuda.memory_allocated(self.device)
            else:
                assert self._trim is not None
                self._trim(0)
                _reset_high_water()
        except (OSError, RuntimeError) as exc:  # measuring is a service: never a batch's failure
            log.warning("cannot measure working memory on %s (%s); residency keeps its estimate", self.device, exc)
            self.available = False
            return
        self._started = True

    def stop(self, outputs: Sequence[torch.Tensor]) -> int | None:
        if self.forced is not None:
            return self.forced
        if not self._started:
            return None
        self._started = False
        try:
            if self.device.type == "cuda":
                return max(torch.cuda.max_memory_allocated(self.device) - self._base, 0)
            assert self._trim is not None
            self._trim(0)
            high, now = _resident()
        except (OSError, RuntimeError, ValueError) as exc:
            log.warning("cannot measure working memory on %s (%s); residency keeps its estimate", self.device, exc)
            self.available = False
            return None
        return max(high - now, 0) + sum(t.numel() * t.element_size() for t in outputs)


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None (another libc: then freed heap would hide the forward's use)."""
    with contextlib.suppress(OSError, AttributeError):
        fn = ctypes.CDLL(None).malloc_trim
        fn.argtypes = [ctypes.c_size_t]
        fn.restype = ctypes.c_int
        trim: Callable[[int], int] = fn
        return trim
    return None


def _can_reset() -> bool:
    try:
        _reset_high_water()
        _resident()
    except (OSError, ValueError):
        return False
    return True


def _reset_high_water() -> None:
    with open(_CLEAR_REFS, "w") as f:
        f.write(_RESET_HIGH_WATER)


def _resident() -> tuple[int, int]:
    """(peak, current) resident bytes of this process, from /proc/self/status."""
    found: dict[str, int] = {}
    with open(_STATUS) as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                found[key] = int(value.split()[0]) * 1024  # the kernel writes kB
    if len(found) != 2:
        raise ValueError(f"{_STATUS} has no VmHWM and VmRSS")
    return found["VmHWM"], found["VmRSS"]
