"""The room's record of one model (``policy.Residency`` keeps one per configured model): where it is, what it
holds on each of its devices and in host memory, and its work.

A model configured on several devices (``--device cuda:0,cuda:1``, or ``cpu`` with ``--workers 2``) runs a worker
per entry of ``devices``, and each worker loads its own copy of the weights: a device named twice holds two
copies, and each worker parked in host memory keeps its own copy there (issue 27), also once back on its device
(``kept``: the page-locked copy is made once and reused by every later move). A run takes the working memory of
the one device whose worker runs it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from diffusiond.daemon.residency.decisions import Move, Tier
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

    def on(self, device: str) -> int:
        """Bytes it holds on ``device``: its weights once per worker there, if resident, and its runs there."""
        weights = self.weight_bytes * self.devices.count(device) if self.resident else 0
        return weights + sum(r for _, r, _, d in self.running if d == device)

    def frees(self, device: str) -> int:
        """What its weights leaving would free on ``device``."""
        return self.weight_bytes * self.devices.count(device)

    @property
    def resident(self) -> bool:
        return self.tier in ("device", "loading")

    @property
    def idle(self) -> bool:
        return self.queued == 0 and not self.running

    @property
    def reserved(self) -> int:
        return sum(r for _, r, _, _ in self.running)
