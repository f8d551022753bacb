"""The slot arena: one memfd of shared memory, carved into slots for outputs.

memfd memory has no name in /dev/shm and belongs to whoever holds a mapping or an fd, so when a
process dies the kernel frees it: nothing can leak across crashes. The owner (a worker) maps the
arena read-write and allocates slots; the peer (the engine) receives the fd once and maps it
read-only, so outputs are read where they were written.

Allocation is explicit and accounted (bytes in use, high-water mark). When no slot is free the
allocator waits, up to a timeout, for releases, then raises ``ArenaFull`` with the sizes: it never
hands out memory that is still in use. An output that can never fit gets a ``DedicatedBuffer``,
its own memfd, sent with its frame.

``on_map``/``on_unmap`` hooks let the owner register the mapping with CUDA (``cudaHostRegister``)
once, so device-to-host copies land in it at full PCIe speed; see ``ipc.cuda_host``.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import fcntl
import mmap
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from diffusiond.ipc.errors import ArenaError, ArenaFull, SlotTooLarge

MapHook = Callable[[int, int], object]  # (address, nbytes); any return value is ignored
ALIGN = 4096


def _align(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


F_SEAL_FUTURE_WRITE = 0x0010  # Linux 5.1; not in Python's fcntl module


def memfd(name: str, nbytes: int) -> int:
    """An anonymous shared-memory file of ``nbytes`` (close-on-exec, sealable)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
    except BaseException:
        os.close(fd)
        raise
    return fd


def seal_future_writes(fd: int) -> None:
    """After the owner has mapped ``fd`` read-write: nobody may write to it any more except
    through that mapping. Whoever gets the fd later (the engine, a local client it hands an
    output to) can map it read-only and nothing else: not even by reopening /proc/PID/fd/N
    read-write, which memfd would otherwise allow. Kernels before 5.1 lack the seal; there the
    engine does not hand fds to clients (``sealed`` says which)."""
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, F_SEAL_FUTURE_WRITE)


def is_sealed(fd: int) -> bool:
    try:
        return bool(fcntl.fcntl(fd, fcntl.F_GET_SEALS) & F_SEAL_FUTURE_WRITE)
    except OSError:
        return False


def address_of(mm: mmap.mmap) -> int:
    """Base address of a writable mapping (for cudaHostRegister)."""
    obj = ctypes.c_char.from_buffer(mm)
    try:
        return ctypes.addressof(obj)
    finally:
        del obj  # release the export so the mapping can be closed later


@dataclass(frozen=True, slots=True)
class Slot:
    id: int
    offset: int
    nbytes: int  # bytes asked for; the reservation is rounded up to ALIGN


class Arena:
    """Owner side: read-write mapping plus a thread-safe first-fit allocator."""

    def __init__(
        self,
        nbytes: int,
        *,
        name: str = "diffusiond-arena",
        on_map: MapHook | None = None,
        on_unmap: MapHook | None = None,
    ) -> None:
        if nbytes <= 0:
            raise ValueError(f"arena size must be positive, got {nbytes}")
        self.capacity = _align(nbytes)
        self.fd = memfd(name, self.capacity)
        self._mm = mmap.mmap(self.fd, self.capacity, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        with contextlib.suppress(OSError):
            seal_future_writes(self.fd)
        self._view = memoryview(self._mm)
        self._on_unmap = on_unmap
        self.address = address_of(self._mm)
        if on_map is not None:
            on_map(self.address, self.capacity)
        self._cond = threading.Condition()
        self._free: list[tuple[int, int]] = [(0, self.capacity)]  # sorted (offset, size)
        self._slots: dict[int, tuple[int, int]] = {}  # id -> (offset, reserved)
        self._next_id = 1
        self.in_use = 0
        self.high_water = 0
        self.closed = False

    # allocation -----------------------------------------------------------------------------
    def allocate(self, nbytes: int, timeout: float | None = None) -> Slot:
        """A slot of at least ``nbytes``; waits up to ``timeout`` seconds for releases."""
        need = _align(max(nbytes, 1))
        if need > self.capacity:
            raise SlotTooLarge(f"output of {nbytes} bytes is larger than the arena of {self.capacity} bytes")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                if self.closed:
                    raise ArenaError("arena is closed")
                slot = self._take(need, nbytes)
                if slot is not None:
                    return slot
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise ArenaFull(self.full(nbytes, timeout or 0.0))
                self._cond.wait(remaining)

    def full(self, nbytes: int, waited: float) -> str:
        """Why no slot of ``nbytes`` came after ``waited`` seconds, and what to do."""
        return (f"no free slot of {nbytes} bytes after {waited:.1f}s: {self.in_use} of {self.capacity} bytes in use "
                f"in {len(self._slots)} slots, largest free range {self.largest_free} bytes; raise --arena-mb or fetch "
                "and release outputs sooner")

    def try_allocate(self, nbytes: int) -> Slot | None:
        need = _align(max(nbytes, 1))
        if need > self.capacity:
            raise SlotTooLarge(f"output of {nbytes} bytes is larger than the arena of {self.capacity} bytes")
        with self._cond:
            return self._take(need, nbytes)

    def _take(self, need: int, nbytes: int) -> Slot | None:
        for i, (off, size) in enumerate(self._free):
            if size >= need:
                if size == need:
                    del self._free[i]
                else:
                    self._free[i] = (off + need, size - need)
                slot = Slot(self._next_id, off, nbytes)
                self._next_id += 1
                self._slots[slot.id] = (off, need)
                self.in_use += need
                self.high_water = max(self.high_water, self.in_use)
                return slot
        return None

    def release(self, slot_id: int) -> int:
        """Return a slot's range to the free list (coalescing); returns the bytes freed."""
        with self._cond:
            try:
                off, size = self._slots.pop(slot_id)
            except KeyError:
                raise ArenaError(f"release of unknown or already released slot {slot_id}") from None
            self.in_use -= size
            i = bisect.bisect_left(self._free, (off, 0))
            self._free.insert(i, (off, size))
            # merge with the right neighbour, then the left one
            if i + 1 < len(self._free) and off + size == self._free[i + 1][0]:
                self._free[i] = (off, size + self._free[i + 1][1])
                del self._free[i + 1]
            if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == off:
                self._free[i - 1] = (self._free[i - 1][0], self._free[i - 1][1] + self._free[i][1])
                del self._free[i]
            self._cond.notify_all()
            return size

    @property
    def largest_free(self) -> int:
        """The largest request that fits now. Allocation is first-fit over contiguous ranges, so the free bytes
        (``capacity - in_use``) may be in pieces that each hold less than a waiting output."""
        with self._cond:
            return max((size for _, size in self._free), default=0)

    @property
    def slots_in_use(self) -> int:
        with self._cond:
            return len(self._slots)

    def buffer(self, slot: Slot) -> memoryview:
        """Writable view of exactly the slot's requested bytes."""
        return self._view[slot.offset : slot.offset + slot.nbytes]

    def close(self) -> None:
        """Unregister (hook), unmap and close. Waiters get ArenaError."""
        with self._cond:
            if self.closed:
                return
            self.closed = True
            self._cond.notify_all()
        if self._on_unmap is not None:
            self._on_unmap(self.address, self.capacity)
        self._view.release()
        self._mm.close()
        os.close(self.fd)


class DedicatedBuffer:
    """A one-off memfd for an output larger than the arena. The fd travels with OUTPUT_READY."""

    def __init__(self, nbytes: int, *, name: str = "diffusiond-output") -> None:
        self.nbytes = nbytes
        self.fd = memfd(name, max(nbytes, 1))
        self._mm = mmap.mmap(self.fd, max(nbytes, 1), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        with contextlib.suppress(OSError):
            seal_future_writes(self.fd)
        self._view = memoryview(self._mm)

    def buffer(self) -> memoryview:
        return self._view[: self.nbytes]

    def unmap(self) -> None:
        """Drop the owner's mapping; the fd (and so the memory) lives on until it is sent and closed."""
        self._view.release()
        self._mm.close()


class MappedView:
    """Peer side: a read-only mapping of an arena or dedicated memfd received over the channel."""

    def __init__(self, fd: int, nbytes: int, *, close_fd: bool = True) -> None:
        size = os.fstat(fd).st_size
        if size < nbytes:
            os.close(fd)
            raise ArenaError(f"shared memory fd is {size} bytes, the peer announced {nbytes}")
        try:
            self._mm = mmap.mmap(fd, max(nbytes, 1), mmap.MAP_SHARED, mmap.PROT_READ)
        except BaseException:
            os.close(fd)
            raise
        if close_fd:
            os.close(fd)  # the mapping keeps the memory alive; no fd to leak
        # kept (``close_fd=False``) only when the memory is sealed, so it can be handed on read-only
        self.fd: int | None = None if close_fd else fd
        self.nbytes = nbytes
        self.view = memoryview(self._mm)

    def close(self) -> bool:
        """Unmap; returns False (and keeps the mapping) while zero-copy readers still hold views."""
        try:
            self.view.release()
            self._mm.close()
        except BufferError:
            return False
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        return True
