"""A copy waits for arena room (SLOT_WAIT) while the free bytes lie in pieces: the engine must spill the outputs
whose slots, given back, open one range large enough, not merely as many bytes as are missing. The worker asks
once and then waits for releases (bounded by --slot-timeout-s): spilled outputs that do not join up leave it
waiting until its job fails with ArenaFull, although spilling another unfetched output would have made room.

The fake worker's slots lie where a real ``Arena`` puts them, and go back to it, so the test sees what the
waiting copy would see."""

from __future__ import annotations

import io
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

import numpy as np
import pytest
from enginekit import ARENA, Harness

from diffusiond.daemon.core.jobs import Job
from diffusiond.ipc.arena import Arena
from diffusiond.ipc.messages import OutputReady, SlotWait
from diffusiond.ipc.tensors import TensorDesc

UNIT = ARENA // 16


@pytest.fixture
async def h() -> AsyncIterator[Harness]:
    harness = Harness(retention_s=600)
    await harness.engine.start()
    yield harness
    await harness.close()


async def held_at(h: Harness, arena: Arena, units: list[int]) -> tuple[list[Job], list[int]]:
    """An unfetched npy output (one UNIT, its bytes all ``k``) in each of ``units``, oldest first; every other
    unit is free. Returns the jobs and the slot ids of the units, in order."""
    slots = [arena.allocate(UNIT) for _ in range(ARENA // UNIT)]
    given_back = h.worker.return_slot

    def return_slot(desc: TensorDesc) -> None:  # the fake worker's slots are the arena's
        given_back(desc)
        arena.release(desc.slot_id)

    h.worker.return_slot = return_slot  # type: ignore[method-assign]
    jobs = []
    for k, unit in enumerate(units):
        job = h.submit(output_format="npy", seed=k)
        batch = h.worker.executed[-1]
        h.worker.compute_done(batch)
        slot = slots[unit]
        h.worker.arena[slot.offset : slot.offset + UNIT] = bytes([k]) * UNIT
        h.worker.held[slot.id] = UNIT
        desc = TensorDesc(dtype="uint8", shape=(UNIT,), nbytes=UNIT, slot_id=slot.id, offset=slot.offset)
        h.worker.send(OutputReady(batch.requests[0].request_id, batch.batch_id, desc))
        await h.settle(job)
        jobs.append(job)
    for unit, slot in enumerate(slots):
        if unit not in units:
            arena.release(slot.id)
    return jobs, [slots[u].id for u in units]


async def read(h: Harness, job: Job) -> np.ndarray:
    async with h.engine.open_output(job, 0) as r:
        data = bytes(r.header) + bytes(r.payload)
        r.complete = True
    return np.load(io.BytesIO(data))


async def test_a_waiting_copy_gets_one_range_large_enough_when_the_free_bytes_are_in_pieces(h: Harness) -> None:
    """Units of a 16-unit arena: A is the oldest unfetched output, B a newer one, P1..P5 are being downloaded
    (pinned). Free: 2 units at most in one piece; a 3-unit output waits, 1 unit short. Spilling the oldest (A,
    between the arena's start and P1) frees a piece of one unit, and the wait went on; spilling B joins the free
    units around it into four."""
    arena = Arena(ARENA)
    #            A  P1 .  .  B  .  P2 .  .  P3 .  .  P4 .  .  P5
    jobs, slots = await held_at(h, arena, [0, 1, 4, 6, 9, 12, 15])
    _, p1, _, *pinned = jobs
    async with AsyncExitStack() as downloads:
        for job in (p1, *pinned):
            await downloads.enter_async_context(h.engine.open_output(job, 0))
        assert arena.largest_free == 2 * UNIT
        h.worker.send(SlotWait("r", 3 * UNIT, ARENA - arena.largest_free, ARENA))
        await h.engine.outputs.settled()
        assert arena.try_allocate(3 * UNIT) is not None, "the waiting output finds no range of its size"
        assert h.worker.returned == [slots[2]], "B alone was spilled: A's slot would have opened no range"
    for k, job in enumerate(jobs):  # spilled or not, every output is still there, once, with its bytes
        assert (await read(h, job) == k).all()
    arena.close()


async def test_what_one_slot_frees_is_enough_the_oldest_goes_first(h: Harness) -> None:
    """Without pieces to join (every output the size of the waiting one), a waiting copy still costs the oldest
    unfetched output only."""
    arena = Arena(ARENA)
    units = list(range(0, 16, 2))  # half the arena held, every other unit free
    jobs, slots = await held_at(h, arena, units)
    h.worker.send(SlotWait("r", 2 * UNIT, ARENA - arena.largest_free, ARENA))
    await h.engine.outputs.settled()
    assert h.worker.returned == [slots[0]] and jobs[0].items[0].data is not None
    assert arena.try_allocate(2 * UNIT) is not None
    arena.close()


async def test_asked_again_while_the_spill_is_under_way_nothing_more_is_spilled(h: Harness) -> None:
    """The copier asks again every second while it waits. A second ask that comes before B's spill ended finds B's
    range already left out (it frees itself): that range is on its way, so spilling the oldest output as well
    would cost A's slot for no room."""
    arena = Arena(ARENA)
    jobs, slots = await held_at(h, arena, [0, 1, 4, 6, 9, 12, 15])
    _, p1, _, *pinned = jobs
    async with AsyncExitStack() as downloads:
        for job in (p1, *pinned):
            await downloads.enter_async_context(h.engine.open_output(job, 0))
        ask = SlotWait("r", 3 * UNIT, ARENA - arena.largest_free, ARENA)
        h.worker.send(ask)
        h.worker.send(ask)  # before B's spill ended: the worker has not seen its slot come back yet
        await h.engine.outputs.settled()
        assert h.worker.returned == [slots[2]], "only B needed spilling"
        assert jobs[0].items[0].desc is not None, "A's slot stays in the arena"
    arena.close()
