"""Output path defects in the arena and the copy thread (s54): each test is a user-visible loss or hang."""

from __future__ import annotations

from typing import Any

import torch

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
