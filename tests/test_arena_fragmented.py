"""A copy that waits for arena room whose free bytes lie in pieces: it asks the engine for what it lacks, and asks
again while it waits, so that an output that could land does not fail with ArenaFull."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import diffusiond.worker.copier as copier_module
from diffusiond.ipc import messages as m
from diffusiond.ipc.arena import Arena
from diffusiond.worker.copier import Copier, CopyJob
from diffusiond.worker.state import SharedState

MIB = 1 << 20


def test_a_fragmented_arena_asks_the_engine_for_the_room_it_lacks_and_the_output_lands() -> None:
    """4 MiB arena, four 1 MiB outputs held, the 1st and 3rd given back: 2 MiB free in two pieces, and a 1.5 MiB
    output waits. The engine (as ``Outputs.relieve``) spills ``nbytes - (capacity - in_use)`` bytes of held
    outputs, oldest first. Before: in_use counted the pieces as free, the engine spilled nothing and the job
    failed with ArenaFull after the timeout although an unfetched output could have made room."""
    arena, state, posted = Arena(4 * MIB), SharedState(), []
    held = [arena.allocate(MIB) for _ in range(4)]
    arena.release(held[0].id)
    arena.release(held[2].id)
    spillable = [held[1], held[3]]  # unfetched outputs, oldest first

    def post(msg: Any, *args: Any, **kw: Any) -> None:
        posted.append(msg)
        if isinstance(msg, m.SlotWait):
            need = msg.nbytes - (msg.capacity - msg.in_use)
            while need > 0 and spillable:
                need -= arena.release(spillable.pop(0).id)

    copier = Copier(arena, state, post, device=torch.device("cpu"), slot_timeout_s=0.5)
    state.admit(["r"])
    params = m.BatchParams(width=512, height=1024, steps=1, guidance=1.0)
    copier.process(CopyJob(1, params, [m.RequestSpec(request_id="r", prompt="x", seed=1)],
                           [torch.rand(3, 1024, 512)], None))
    ended = [msg for msg in posted if isinstance(msg, m.RequestEnded)]
    assert not ended, ended[0].message
    (ready,) = [msg for msg in posted if isinstance(msg, m.OutputReady)]
    assert ready.tensor.nbytes == 3 * 1024 * 512 and not ready.tensor.dedicated


def test_a_wait_the_first_spill_does_not_end_asks_again_and_the_output_lands(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine sees only the slots announced to it, so what it spills for the first ask may free bytes that do not
    join the free range (here: the 3rd of four 1 MiB slots, beside no free room). Asked once, the wait ran to its
    timeout and the job failed with ArenaFull; asked again, the 2nd slot goes too and the 2 MiB output lands."""
    monkeypatch.setattr(copier_module, "ASK_AGAIN_S", 0.05)
    arena, state, posted = Arena(4 * MIB), SharedState(), []
    held = [arena.allocate(MIB) for _ in range(4)]
    arena.release(held[0].id)
    spilled_per_ask = [held[2], held[1]]  # one per ask, the first in the wrong place

    def post(msg: Any, *args: Any, **kw: Any) -> None:
        posted.append(msg)
        if isinstance(msg, m.SlotWait) and spilled_per_ask:
            arena.release(spilled_per_ask.pop(0).id)

    copier = Copier(arena, state, post, device=torch.device("cpu"), slot_timeout_s=5)
    state.admit(["r"])
    params = m.BatchParams(width=512, height=1024, steps=1, guidance=1.0)
    copier.process(CopyJob(1, params, [m.RequestSpec(request_id="r", prompt="x", seed=1)],
                           [torch.rand(4, 1024, 512)], None))
    ended = [msg for msg in posted if isinstance(msg, m.RequestEnded)]
    assert not ended, ended[0].message
    assert sum(isinstance(msg, m.SlotWait) for msg in posted) == 2
    (ready,) = [msg for msg in posted if isinstance(msg, m.OutputReady)]
    assert ready.tensor.nbytes == 2 * MIB and not ready.tensor.dedicated
