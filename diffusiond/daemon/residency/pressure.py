"""Other programs come first (issue 27, point 6): watch each GPU's real free memory, make room when it runs low.

The budget (``--device-memory``) bounds what our models may take; it cannot know that a game or a
training run started beside us. So the engine reads each CUDA device's free memory every
``POLL_S`` through NVML (``nvidia-ml-py``, imported lazily: the engine stays free of torch and
CUDA, and NVML reads the driver's numbers without a CUDA context), and hands them to the policy's
``pressure(device, free, reserve)``. When less than ``--reserve-memory`` is free, idle models leave
(the keeper carries the moves out); the policy also remembers the headroom, so while it is short,
``plan`` answers ``waiting_for_memory`` and new jobs wait instead of running out of memory. When the
headroom grows again, the engine is told to dispatch, so those jobs go on by themselves.

NVML is optional (``pip install diffusiond[gpu]``): without it, or without a driver, this logs once
and does nothing, and the budget alone decides.

Device numbers: ``cuda:N`` is the N-th device CUDA shows this process, which is the N-th entry of
``CUDA_VISIBLE_DEVICES`` when that is set (an index or a ``GPU-``/``MIG-`` UUID), else NVML's index N.
NVML orders devices by PCI bus, as CUDA does with ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (what a machine
with several different GPUs should set; on identical GPUs the orders agree).
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from diffusiond.daemon.residency.decisions import Move, Pressure
from diffusiond.daemon.residency.policy import Residency
from diffusiond.daemon.residency.units import format_bytes

log = logging.getLogger(__name__)

POLL_S = 0.5
"""How often free memory is read: an idle model leaves within about this of another program's need."""

GREW_BYTES = 64 << 20
"""Free memory that grew by this much since the last poll may let a waiting job run: dispatch again."""

NvmlId = int | str
FreeReader = Callable[[NvmlId], int]
"""NVML index (or UUID) -> free bytes on that device right now; tests pass a fake."""


def nvml_id(device: str, env: Mapping[str, str] | None = None) -> NvmlId:
    """``cuda:N`` (or ``cuda``) -> the device NVML knows it as, honouring ``CUDA_VISIBLE_DEVICES``."""
    kind, _, index = device.partition(":")
    if kind != "cuda":
        raise ValueError(f"{device!r} is not a CUDA device; only CUDA devices are watched")
    n = int(index or 0)
    visible = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return n
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if n >= len(entries):
        raise ValueError(f"{device}: CUDA_VISIBLE_DEVICES={visible!r} shows {len(entries)} device(s)")
    entry = entries[n]
    return int(entry) if entry.isdigit() else entry


def nvml_reader() -> FreeReader | None:
    """A reader over NVML, or None (logged once, with what to install) where NVML cannot be used."""
    try:
        pynvml: Any = importlib.import_module("pynvml")
    except ImportError:
        log.info("memory pressure from other programs is not watched: NVML is missing "
                 "(pip install 'diffusiond[gpu]', which installs nvidia-ml-py)")
        return None
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...
        log.warning("memory pressure from other programs is not watched: NVML did not start (%s)", exc)
        return None
    handles: dict[NvmlId, Any] = {}

    def read(device: NvmlId) -> int:
        if device not in handles:
            handles[device] = (pynvml.nvmlDeviceGetHandleByIndex(device) if isinstance(device, int)
                               else pynvml.nvmlDeviceGetHandleByUUID(device))
        return int(pynvml.nvmlDeviceGetMemoryInfo(handles[device]).free)

    return read


class PressureWatch:
    """Reads each watched device's free memory and turns the policy's answer into moves.

    ``move`` starts a decision's moves, in their order (the keeper's ``_spawn_moves``: a copy into host memory
    after the drops that make its room); ``on_change`` asks the engine to dispatch (jobs held back by the
    headroom may run now)."""

    def __init__(self, policy: Residency, devices: Sequence[str], reserve_bytes: int, *,
                 move: Callable[[tuple[Move, ...]], None], on_change: Callable[[], None],
                 read: FreeReader | None = None, env: Mapping[str, str] | None = None) -> None:
        self.policy, self.reserve_bytes = policy, reserve_bytes
        self.move, self.on_change = move, on_change
        self.devices = {d: nvml_id(d, env) for d in dict.fromkeys(devices)}
        self.read = read
        self._last_free: dict[str, int] = {}
        self._waiting: dict[str, bool] = {}
        self._failed: set[str] = set()

    def poll(self) -> list[Pressure]:
        """One look at every device: the policy's decisions, with their moves started."""
        decisions = []
        for device, ident in self.devices.items():
            assert self.read is not None
            try:
                free = self.read(ident)
            except Exception as exc:
                if device not in self._failed:
                    log.warning("cannot read the free memory of %s (NVML device %s): %s", device, ident, exc)
                    self._failed.add(device)
                continue
            self._failed.discard(device)
            decision = self.policy.pressure(device, free, self.reserve_bytes)
            decisions.append(decision)
            if decision.moves:
                self.move(decision.moves)
            was = self._waiting.get(device, False)
            if decision.waiting != was:
                (log.warning if decision.waiting else log.info)(
                    "%s: %s", device, decision.reason if decision.waiting
                    else f"{format_bytes(free)} free again: jobs waiting for memory go on")
                self._waiting[device] = decision.waiting
            grew = free - self._last_free.get(device, free) >= GREW_BYTES
            self._last_free[device] = free
            if decision.moves:
                log.info("%s: %s", device, decision.reason)
            if was != decision.waiting or grew:
                self.on_change()
        return decisions

    async def run(self, interval_s: float = POLL_S) -> None:
        """Poll until cancelled; returns at once (having logged why) where NVML is not there."""
        if self.read is None:
            self.read = nvml_reader()
            if self.read is None:
                return
        log.info("watching free memory on %s every %.1f s; reserve %s for other programs",
                 ", ".join(self.devices), interval_s, format_bytes(self.reserve_bytes))
        while True:
            self.poll()
            await asyncio.sleep(interval_s)
