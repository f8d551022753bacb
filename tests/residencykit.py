"""The residency room's test bench (test_residency.py, test_residency_transitions.py): a room of
models, and a fake engine that carries out the room's decisions at once and checks the budget after
every step."""

from __future__ import annotations

from dataclasses import dataclass, field

from diffusiond.daemon.residency.decisions import Evict, Fits, Move, Release, TooLarge, Wait
from diffusiond.daemon.residency.policy import Residency
from diffusiond.daemon.residency.working import Shape

G = 1024**3
S = Shape(64, 64)


def room(budget: int = 6 * G, host: int = 0, models: dict[str, int] | None = None, working: int = G,
         **kw: object) -> Residency:
    """Models of 4 GiB by default, each with 1 GiB of working memory measured for ``S``."""
    r = Residency({"cuda:0": budget}, host, **kw)  # type: ignore[arg-type]
    for name, wb in (models or {"a": 4 * G, "b": 4 * G, "c": 4 * G}).items():
        r.add(name, "cuda:0", wb)
        r.measured(name, S, working)
    return r


@dataclass
class Engine:
    """Does what the room decides, at once, and checks the budget after every step."""

    r: Residency
    keeps: bool = False  # a model woken from host memory keeps its copy there, as a worker on a GPU does (issue 27)
    now: float = 0.0
    loads: list[tuple[str, str]] = field(default_factory=list)
    moves: list[Move] = field(default_factory=list)

    def check(self) -> None:
        for device, budget in self.r.budgets.items():
            assert self.r.device_used(device) <= budget
            on = sum(s.per_device.get(device, 0) for s in self.r.snapshot() if s.residency == "device")
            assert on <= budget
        assert self.r.host_used() <= self.r.host_budget

    def move(self, moves: tuple[Move, ...]) -> None:
        status = {s.name: s for s in self.r.snapshot()}
        for mv in moves:  # a model freeing the host copy it keeps stays, and may have work (issue 27)
            assert isinstance(mv, Release) or (status[mv.model].running == 0 and status[mv.model].queued == 0), mv
            self.r.unloading(mv)
            self.r.unloaded(mv)
            self.moves.append(mv)
            self.check()

    def admit(self, name: str, shape: Shape = S) -> Fits | Wait | TooLarge:
        """Plan until the job may run (loading it if need be), or until the room says wait or refuse."""
        for _ in range(10):
            d = self.r.plan(name, shape)
            if isinstance(d, Evict):
                self.move(d.moves)
                continue
            if isinstance(d, Fits) and d.load_from:
                self.r.loading_started(name)
                self.check()
                self.r.loaded(name, self.now)
                if self.keeps and d.load_from == "host":
                    self.r.keeps(name, sum(next(s for s in self.r.snapshot() if s.name == name).per_device.values()))
                    self.check()
                self.loads.append((name, d.load_from))
            return d
        raise AssertionError("the room kept asking for evictions")

    def run(self, name: str, shape: Shape = S, keep_alive_s: float | None = None) -> None:
        self.r.queue(name)
        d = self.admit(name, shape)
        assert isinstance(d, Fits), d
        self.r.start(name, shape, self.now)
        self.check()
        self.now += 1
        self.r.finish(name, shape, self.now, keep_alive_s=keep_alive_s)
        self.check()


def on_device(r: Residency) -> list[str]:
    return [s.name for s in r.snapshot() if s.residency == "device"]


def tier(r: Residency, name: str) -> str:
    return next(s.residency for s in r.snapshot() if s.name == name)
