"""Each device's budget at start: what ``--device-memory`` says, made bytes against the device's own memory.

Issue 27: without the flag a daemon must not load more than its device has free when it starts (less
``--reserve-memory``: other programs come first), and ``--device-memory 0.8`` means that share of the device's
total. Both need the device's total and free memory, read without torch (the engine never loads it): NVML for a
CUDA device (``nvidia-ml-py``, which the pressure watch reads too), ``/proc/meminfo`` for the CPU, whose memory is
host memory (MemTotal, MemAvailable), so the CPU suite runs the same path a GPU daemon does. A device whose
memory cannot be read keeps no bound by default (the log says why); a share there is refused at start, since
it has nothing to be a share of.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from diffusiond.daemon.residency.pressure import nvml_id
from diffusiond.daemon.residency.units import format_bytes, parse_size

NO_BUDGET: Final = 1 << 62
"""The budget where none can be set: more than any device, so residency only moves models by keep-alive."""
ACCELERATOR_RESERVE: Final = 1 << 30
"""``--reserve-memory``'s default on an accelerator. On the CPU MemAvailable already leaves the kernel its
caches, so nothing more is kept back unless asked."""

MemoryReader = Callable[[str], "tuple[int, int] | str"]
"""Device -> (total, free) bytes, or why they cannot be read."""


@dataclass(frozen=True)
class Budget:
    nbytes: int
    source: str  # how it was chosen, for the start log and errors


def read_memory(device: str) -> tuple[int, int] | str:
    """The device's total and free bytes now, or a sentence saying why they cannot be read."""
    if device.startswith("cpu"):
        return _meminfo(Path("/proc/meminfo"))
    if device.startswith("cuda"):
        return _nvml(device)
    return f"the memory of {device} cannot be read without torch (only cpu and cuda devices are measured)"


def _meminfo(path: Path) -> tuple[int, int] | str:
    try:
        fields = dict(line.split(":", 1) for line in path.read_text().splitlines() if ":" in line)
        total, free = (int(fields[k].split()[0]) * 1024 for k in ("MemTotal", "MemAvailable"))
    except (OSError, KeyError, ValueError, IndexError) as exc:
        return f"{path} cannot be read ({exc})"
    return total, free


def _nvml(device: str) -> tuple[int, int] | str:
    try:
        pynvml: Any = importlib.import_module("pynvml")
    except ImportError:
        return "NVML is missing (pip install 'diffusiond[gpu]', which installs nvidia-ml-py)"
    try:
        pynvml.nvmlInit()
        ident = nvml_id(device)
        handle = (pynvml.nvmlDeviceGetHandleByIndex(ident) if isinstance(ident, int)
                  else pynvml.nvmlDeviceGetHandleByUUID(ident))
        info = pynvml.nvmlDeviceGetMemoryInfo(handle)
        return int(info.total), int(info.free)
    except Exception as exc:  # NVMLError_*, a CUDA_VISIBLE_DEVICES that does not show the device
        return f"NVML cannot read {device} ({exc})"


def reserve_bytes(reserve_memory: str | int | float | None, device: str) -> int:
    """What is kept free for other programs on ``device`` (``--reserve-memory``, given or its default)."""
    if reserve_memory is not None:
        return parse_size(reserve_memory).resolve(None)
    return 0 if device.startswith("cpu") else ACCELERATOR_RESERVE


def resolve(device_memory: str | int | float | None, reserve_memory: str | int | float | None, device: str,
            read: MemoryReader = read_memory) -> Budget:
    """``device``'s budget: the size given; a share of its total; else its free memory less the reserve.
    A ValueError (the start's error) where a share is given and the total cannot be read."""
    size = None if device_memory is None else parse_size(device_memory)
    if size is not None and size.nbytes is not None:
        return Budget(size.nbytes, f"--device-memory {device_memory}")
    memory = read(device)
    if isinstance(memory, str):
        if size is not None:
            raise ValueError(f"--device-memory {device_memory!r} is a share of {device}'s total memory, which "
                             f"cannot be read: {memory}; give a size such as 20GiB")
        return Budget(NO_BUDGET, f"no bound: {memory}; give --device-memory SIZE to set one")
    total, free = memory
    if size is not None:
        return Budget(size.resolve(total), f"--device-memory {device_memory}: {size.share:g} of the "
                                           f"{format_bytes(total)} {device} has")
    reserve = reserve_bytes(reserve_memory, device)
    return Budget(max(free - reserve, 0), f"the {format_bytes(free)} free on {device} at start less "
                                          f"{format_bytes(reserve)} reserved (--reserve-memory), read once "
                                          "at the daemon's start; --device-memory SIZE or SHARE sets it, "
                                          "or a restart once other programs have freed memory")
