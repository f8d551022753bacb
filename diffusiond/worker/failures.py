"""How a worker reads a failed forward: fatal to its process (the device cannot be trusted), out of
memory (the job's problem: retried smaller, then refused with what would help), and the words of the
message a person reads."""

from __future__ import annotations

from typing import Any

import torch

from diffusiond.ipc.messages import Execute


def is_fatal(exc: BaseException) -> bool:
    """Errors after which the device (and so this process) cannot be trusted any more."""
    if type(exc).__name__ == "AcceleratorError":
        return True
    text = str(exc)
    return any(s in text for s in _FATAL_TEXT)


_FATAL_TEXT = ("illegal memory access", "device-side assert", "unspecified launch failure", "ECC error")


def is_oom(exc: BaseException) -> bool:
    """Out of memory: CUDA's allocator (``torch.OutOfMemoryError``), Python's own, or torch's CPU
    allocator, which raises a plain RuntimeError naming itself. A job's problem, never the process's."""
    if isinstance(exc, torch.OutOfMemoryError | MemoryError):
        return True
    return isinstance(exc, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(exc)


def oom_shape(batch: Execute, size: int) -> str:
    """What a person reads in an out-of-memory message: WxH, frames where a video, the batch."""
    p = batch.params
    frames = f", {p.num_frames} frames" if p.num_frames else ""
    return f"{p.width}x{p.height}{frames}, batch of {size}"


def oom_message(pipeline: Any, batch: Execute, size: int, part: int, exc: BaseException) -> str:
    """The refusal of a batch (``part``: of its half) that ran out of memory even when retried, with what would help."""
    where = f" (this half: {part})" if part else ""
    return (f"out of memory running {pipeline.name} on {pipeline.device} at "
            f"{oom_shape(batch, size)}{where}, even after emptying the allocator's cache and retrying"
            f"{' the batch in halves' if part else ''}: {first_line(exc)}. What would help: a smaller size, "
            "fewer frames or a smaller batch (--max-batch), fewer models or other programs on the device "
            "(--device-memory), or CPU offloading where the model supports it")


def first_line(exc: BaseException) -> str:
    """torch's out-of-memory text runs to a paragraph of allocator advice; its first sentence says enough."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."
