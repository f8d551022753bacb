"""The slot arena and tensor descriptors: accounting, waiting, exact-view writes, zero-copy reads."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import shm_entries
from diffusiond.ipc.arena import ALIGN, Arena, DedicatedBuffer, MappedView
from diffusiond.ipc.errors import ArenaError, ArenaFull, SlotTooLarge
from diffusiond.ipc.tensors import as_numpy, as_torch, describe, write_tensor


def test_arena_accounting_and_high_water() -> None:
    arena = Arena(1 << 20)
    a = arena.allocate(1000)
    b = arena.allocate(5000)
    assert arena.in_use == ALIGN + 2 * ALIGN
    assert arena.slots_in_use == 2
    arena.release(a.id)
    assert arena.in_use == 2 * ALIGN
    assert arena.high_water == 3 * ALIGN
    arena.release(b.id)
    assert arena.in_use == 0 and arena.slots_in_use == 0
    with pytest.raises(ArenaError, match="already released"):
        arena.release(b.id)
    arena.close()


def test_arena_never_hands_out_memory_in_use_and_times_out_with_sizes() -> None:
    arena = Arena(8 * ALIGN)
    held = arena.allocate(6 * ALIGN)
    with pytest.raises(ArenaFull) as err:
        arena.allocate(4 * ALIGN, timeout=0.05)
    msg = str(err.value)
    assert str(4 * ALIGN) in msg and str(6 * ALIGN) in msg and str(8 * ALIGN) in msg
    arena.release(held.id)
    arena.close()


def test_arena_waiter_gets_slot_when_another_thread_releases() -> None:
    arena = Arena(4 * ALIGN)
    held = arena.allocate(4 * ALIGN)
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(arena.allocate(3 * ALIGN, timeout=30).offset))
    waiter.start()
    arena.release(held.id)
    waiter.join(30)
    assert got == [0]
    arena.close()


def test_arena_output_larger_than_arena_is_refused_for_a_dedicated_buffer() -> None:
    arena = Arena(4 * ALIGN)
    with pytest.raises(SlotTooLarge, match="larger than the arena"):
        arena.allocate(5 * ALIGN)
    big = DedicatedBuffer(5 * ALIGN)
    big.buffer()[:3] = b"abc"
    peer = MappedView(os.dup(big.fd), big.nbytes)
    assert bytes(peer.view[:3]) == b"abc"
    big.unmap()
    os.close(big.fd)
    assert bytes(peer.view[:3]) == b"abc"  # the peer's mapping keeps the memory alive
    assert peer.close()
    arena.close()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 6 * ALIGN)), max_size=60))
def test_arena_random_allocations_never_overlap(ops: list[tuple[bool, int]]) -> None:
    arena = Arena(32 * ALIGN)
    live: dict[int, tuple[int, int]] = {}
    for alloc, size in ops:
        if alloc or not live:
            slot = arena.try_allocate(size)
            if slot is None:
                continue
            end = slot.offset + size
            assert end <= arena.capacity
            for off, n in live.values():
                assert end <= off or slot.offset >= off + n, "slots overlap"
            live[slot.id] = (slot.offset, size)
        else:
            arena.release(next(iter(live)))
            live.pop(next(iter(live)))
    for sid in list(live):
        arena.release(sid)
    assert arena.in_use == 0
    assert arena.try_allocate(arena.capacity) is not None  # fully coalesced again
    arena.close()


def test_arena_view_of_batch_tensor_moves_only_its_own_bytes() -> None:
    """A per-request view of a 32-request batch tensor."""
    batch = torch.rand(32, 3, 128, 128)
    arena = Arena(8 << 20)
    view = batch[17]
    slot = arena.allocate(view.numel() * view.element_size())
    write_tensor(arena.buffer(slot), view)
    desc = describe(view, slot.id, slot.offset)
    assert desc.nbytes == 3 * 128 * 128 * 4  # the view, not the 6 MB storage
    assert arena.in_use < 2 * desc.nbytes
    assert torch.equal(as_torch(arena._view, desc), view)
    # a strided (non-contiguous) view too: it lands dense, and only its elements are written
    strided = batch[:, 1, ::4, ::2][5]
    slot2 = arena.allocate(strided.numel() * 4)
    write_tensor(arena.buffer(slot2), strided)
    assert torch.equal(as_torch(arena._view, describe(strided, slot2.id, slot2.offset)), strided)
    arena.close()


def test_arena_reads_are_zero_copy_views() -> None:
    arena = Arena(1 << 20)
    peer = MappedView(os.dup(arena.fd), arena.capacity)
    t = torch.arange(60, dtype=torch.float32).reshape(3, 4, 5)
    slot = arena.allocate(t.numel() * 4)
    write_tensor(arena.buffer(slot), t)
    desc = describe(t, slot.id, slot.offset)
    arr = as_numpy(peer.view, desc)
    assert np.shares_memory(arr, np.frombuffer(peer.view, np.uint8))
    assert not arr.flags.writeable
    assert np.array_equal(arr, t.numpy())
    # a later write by the owner is visible through the same view: same memory, no copy
    arena.buffer(slot)[:4] = np.float32(99).tobytes()
    assert arr[0, 0, 0] == 99
    assert not peer.close()  # refused while a reader holds a view
    del arr
    assert peer.close()
    arena.close()


def test_arena_has_no_name_in_dev_shm() -> None:
    before = shm_entries()
    arena = Arena(1 << 20)
    assert shm_entries() == before
    assert os.readlink(f"/proc/self/fd/{arena.fd}").startswith("/memfd:diffusiond-arena")
    arena.close()


def test_arena_map_hooks_called_once_each() -> None:
    calls: list[tuple[str, int, int]] = []
    arena = Arena(
        1 << 20,
        on_map=lambda a, n: calls.append(("map", a, n)),
        on_unmap=lambda a, n: calls.append(("unmap", a, n)),
    )
    for _ in range(5):
        arena.release(arena.allocate(100).id)
    arena.close()
    assert [c[0] for c in calls] == ["map", "unmap"]
    assert calls[0][1:] == calls[1][1:] == (arena.address, arena.capacity)
