"""Live updates (issue 29) in the engine's bookkeeping, in process: fake workers whose answers the test
holds back, so orderings that a real daemon reaches only by luck are reached every time.

``LiveLoras`` and ``LiveComponents`` are driven as the engine drives them: ``update`` for the trainer's
call, ``replay`` for a worker that came up (``Engine._prepare_worker``). A fake worker records what it
was sent and answers when the test lets it.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from diffusiond.client.weights import pack
from diffusiond.daemon.core.loras import LoraRegistry
from diffusiond.daemon.core.weights import LiveComponents, LiveLoras
from diffusiond.ipc.messages import Ack, UpdateLora, UpdateWeights
from diffusiond.protocol import WorkerState

STATE = {"unet.a.to_q.lora_A.weight": np.ones((2, 4), np.float32),
         "unet.a.to_q.lora_B.weight": np.ones((4, 2), np.float32)}


class FakeWorker:
    def __init__(self, name: str, state: WorkerState = WorkerState.READY, refuse: str = "") -> None:
        self.name = name
        self.state = state
        self.refuse = refuse
        self.got: list[Any] = []
        self.gate: asyncio.Event | None = None  # set: the answer waits for it

    async def command(self, msg: Any, timeout: float, fds: Any = ()) -> Ack:
        for fd in fds:
            os.close(fd)
        self.got.append(msg)
        if self.gate is not None:
            await self.gate.wait()
        return Ack(0, not self.refuse, self.refuse)


@dataclass
class FakeModel:
    name: str
    workers: list[Any]
    lora_errors: dict[str, str] = field(default_factory=dict)


async def lora_update(live: LiveLoras, name: str, models: list[FakeModel], state: dict[str, Any] = STATE) -> int:
    fd, tensors = pack(state)
    return await live.update(UpdateLora(name, tensors), [fd], models, 5)  # type: ignore[arg-type]


async def until(cond: Any) -> None:
    for _ in range(1000):
        if cond():
            return
        await asyncio.sleep(0)
    raise AssertionError("the condition never held")


async def test_a_worker_starting_while_the_first_update_is_in_flight_gets_it() -> None:
    """The first update of a session (nothing kept yet) is on its way to the live workers when another
    worker of the model comes up: the new one was not among the live ones, so its replay must send it."""
    live = LiveLoras(LoraRegistry({}, 3))
    old = FakeWorker("w0")
    old.gate = asyncio.Event()
    model = FakeModel("tiny", [old])
    update = asyncio.ensure_future(lora_update(live, "trainer", [model]))
    await until(lambda: old.got)  # the update holds the lock, waiting for w0's answer
    new = FakeWorker("w1", WorkerState.STARTING)
    model.workers.append(new)
    replay = asyncio.ensure_future(live.replay(model, new, 5))  # type: ignore[arg-type]
    for _ in range(20):
        await asyncio.sleep(0)
    old.gate.set()
    version = await update
    await replay
    assert [m.version for m in new.got] == [version] == [1]
    assert "trainer" not in model.lora_errors


async def test_a_worker_starting_while_the_first_component_update_is_in_flight_gets_it() -> None:
    live = LiveComponents()
    old = FakeWorker("w0")
    old.gate = asyncio.Event()
    model = FakeModel("tiny", [old])
    fd, tensors = pack({"conv_out.weight": np.zeros((4, 4), np.float32)})
    update = asyncio.ensure_future(live.update(UpdateWeights("tiny", "unet", tensors), [fd],
                                               lambda _name: model, 5))  # type: ignore[arg-type,return-value]
    await until(lambda: old.got)
    new = FakeWorker("w1", WorkerState.STARTING)
    model.workers.append(new)
    replay = asyncio.ensure_future(live.replay(model, new, 5))  # type: ignore[arg-type]
    for _ in range(20):
        await asyncio.sleep(0)
    old.gate.set()
    version = await update
    await replay
    assert [m.version for m in new.got] == [version] == [1]
