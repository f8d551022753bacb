"""Keep-alive expiries do not wait on one another (issue 27): the keeper, with a fake pool whose moves
end when the test says, sends every expired model off at once, and a quick move ends while a slow one
(a large model's copy to host memory) is still under way."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest
from enginekit import until
from residencykit import Engine, G, S, tier

import diffusiond.daemon.residency.keeper as keeper
from diffusiond.daemon.config import DaemonConfig
from diffusiond.daemon.metrics import Metrics
from diffusiond.daemon.residency.policy import Residency
from diffusiond.protocol import WorkerState


@dataclass
class _Worker:
    state: WorkerState = WorkerState.READY


@dataclass
class _Config:
    devices: tuple[str, ...] = ("cpu",)


@dataclass
class _Model:
    name: str
    config: _Config = field(default_factory=_Config)
    workers: list[_Worker] = field(default_factory=lambda: [_Worker()])


class _Pool:
    """Moves off the device that end when their gate opens (the quick ones' are open from the start)."""

    def __init__(self, slow: set[str], names: str) -> None:
        self.models = {n: _Model(n) for n in names}
        self.gates = {n: asyncio.Event() for n in names}
        for n in set(names) - slow:
            self.gates[n].set()
        self.begun: list[str] = []

    async def retire(self, model: _Model) -> None:
        self.begun.append(model.name)
        await self.gates[model.name].wait()

    sleep_model = retire





async def test_a_slow_expiry_holds_no_other_model_past_its_keep_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(keeper, "EXPIRY_CHECK_S", 0.01)
    pool = _Pool(slow={"a"}, names="abc")
    k = keeper.Keeper(DaemonConfig(), pool, Metrics(), on_change=lambda: None)  # type: ignore[arg-type]
    k.policy = room = Residency({"cpu": 20 * G}, 0)
    for name in "abc":
        room.add(name, "cpu", G)
        room.measured(name, S, G)
    e = Engine(room)
    for name in "abc":  # a's deadline first: its move is the one the others used to wait behind
        e.run(name, keep_alive_s=0)
    k.started()
    try:
        await until(lambda: tier(room, "b") == tier(room, "c") == "disk", 10, "b and c to leave while a's move runs")
        assert pool.begun[0] == "a" and sorted(pool.begun) == ["a", "b", "c"], pool.begun
        assert k.moving == {"a"} and tier(room, "a") == "device"  # still leaving: counted where it was
        pool.gates["a"].set()
        await until(lambda: tier(room, "a") == "disk", 10, "a's move to end")
        assert not k.moving
    finally:
        k.stop()
