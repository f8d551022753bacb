"""The room's record of one model (``policy.Residency`` keeps one per configured model): where it is, what it
holds on each of its devices and in host memory, and its work.

A model configured on several devices (``--device cuda:0,cuda:1``, or ``cpu`` with ``--workers 2``) runs a worker
per entry of ``devices``, and each worker loads its own copy of the weights: a device named twice holds two
copies, and each worker parked in host memory keeps its own copy there (issue 27), also once back on its device
(``kept``: the page-locked copy is made once and reused by every later move). A run takes the working memory of
the one device whose worker runs it.

One worker of several may die while the others serve on: its copy leaves the books (``lost``) and
comes back with its replacement's READY, so the books count the copies the live workers hold, no more, no less.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from diffusiond.daemon.residency.decisions import ModelStatus, Move, Tier
from diffusiond.daemon.residency.units import FOREVER
from diffusiond.daemon.residency.working import Shape


@dataclass
class ModelEntry:
    name: str
    devices: tuple[str, ...]  # one worker per entry, each with its own copy of the weights (a device twice: two)
    weight_bytes: int
    pinned: bool
    keep_alive_s: float | None
    hints: tuple[str, ...]
    host_bytes: int = 0  # what it keeps in host memory while on the device: an offloaded model's (host_memory.py)
    kept: int = 0  # its workers' kept page-locked copies of its weights (all of them, as they report; issue 27)
    tier: Tier = "disk"
    loading_from: Tier | None = None
    leaving: Move | None = None
    releasing: Move | None = None  # a ``decisions.Release`` of its kept host copy under way (host_memory.py)
    last_used: float = float("-inf")
    deadline: float = FOREVER
    queued: int = 0
    running: list[tuple[Shape, int, int, str]] = field(default_factory=list)  # (shape, reserved, jobs, device)
    reason: str = "not loaded yet"
    lost: list[str] = field(default_factory=list)  # on its device: the devices of its dead, not yet back, workers

    @property
    def device(self) -> str:
        """The first of its devices, which messages name it by (turns go by all of them: ``turns.py``)."""
        return self.devices[0]

    @property
    def places(self) -> tuple[str, ...]:
        """Its devices, each once."""
        return tuple(dict.fromkeys(self.devices))

    @property
    def where(self) -> str:
        return " and ".join(self.places)

    @property
    def workers(self) -> int:
        """How many workers hold its weights (or would, off its device): all but the ``lost`` ones."""
        return len(self.devices) - len(self.lost)

    def on(self, device: str) -> int:
        """Bytes it holds on ``device``: its weights once per live worker there, if resident, and its runs there."""
        weights = self.frees(device) if self.resident else 0
        return weights + sum(r for _, r, _, d in self.running if d == device)

    def booked(self, device: str) -> int:
        """What the budget counts of it on ``device``: what it holds (``on``) and, while resident, the copy of each
        lost worker there, which the pool's replacement will load again without asking the room."""
        return self.on(device) + (self.weight_bytes * self.lost.count(device) if self.resident else 0)

    def frees(self, device: str) -> int:
        """What its weights leaving would free on ``device``: a copy per live worker there."""
        return self.weight_bytes * (self.devices.count(device) - self.lost.count(device))

    def size(self, device: str) -> int:
        """Its weights on ``device`` with every worker up: what it needs there to fit at all."""
        return self.weight_bytes * self.devices.count(device)

    def lose(self, device: str, kept: int, reason: str) -> bool:
        """A worker on ``device`` died, which kept ``kept`` bytes of host copy: False if it was the last (or the
        model is not simply on its device: a move or load under way), so the whole model goes to disk; else only
        its copy leaves, and its runs end as the engine reports them (a device named twice cannot tell whose)."""
        if self.tier != "device" or self.leaving is not None or self.workers < 2 or (
                self.devices.count(device) <= self.lost.count(device)):
            return False
        self.lost.append(device)
        self.kept = max(self.kept - kept, 0)
        self.reason = f"a worker on {device} died: {reason}; {self.workers} left serve until it is replaced"
        return True

    def rejoin(self, device: str) -> bool:
        """A worker came up on ``device`` beside the live ones: True where it takes a lost worker's place."""
        if self.tier != "device" or device not in self.lost:
            return False
        self.lost.remove(device)
        self.reason = f"a worker on {device} replaced the one that died; loaded onto {self.where}"
        return True

    @property
    def resident(self) -> bool:
        return self.tier in ("device", "loading")

    @property
    def idle(self) -> bool:
        return self.queued == 0 and not self.running

    @property
    def reserved(self) -> int:
        return sum(r for _, r, _, _ in self.running)

    def status(self, host_bytes: int, kept: int) -> ModelStatus:
        """What ``GET /v1/models`` shows of it, given what it holds in host memory and its kept copy."""
        on = self.tier == "device"
        return ModelStatus(
            name=self.name, device=self.device, residency=self.tier,
            device_bytes=sum(self.on(d) for d in self.places), host_bytes=host_bytes,
            keep_alive_until=self.deadline if on and self.deadline != FOREVER else None,
            forever=on and self.deadline == FOREVER, pinned=self.pinned, queued=self.queued,
            running=sum(j for _, _, j, _ in self.running), reason=self.reason,
            per_device={d: self.on(d) for d in self.places}, kept_bytes=kept)
