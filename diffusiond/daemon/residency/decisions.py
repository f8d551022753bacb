"""What the room answers: each decision is a frozen value with the reason a log line or an error carries.

Decisions say what should happen; the engine makes it happen (it sends the worker its commands) and
reports back through ``Residency``'s transitions. Nothing here refers to processes or time.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Final, Literal

from diffusiond.daemon.residency.working import Shape

Tier = Literal["device", "host", "disk", "loading"]
"""Where a model's weights are: on its device, in host memory, only in its files, or on their way in."""

MODEL_TOO_LARGE: Final = "model_too_large"
OUT_OF_MEMORY: Final = "out_of_memory"
# A job's stages while the room holds it back, as the jobs API and SSE ``status`` events name them.
LOADING: Final = "loading"
WAITING_FOR_MEMORY: Final = "waiting_for_memory"
# Its model yields the device to another whose job waited past --max-model-wait (turns.py).
WAITING_FOR_TURN: Final = "waiting_for_turn"


@dataclass(frozen=True)
class Move:
    """One model's weights leaving a tier: device -> host or disk, or host -> disk.

    Moves come in the order to carry them out: a host -> disk drop makes the room in host memory that the
    device -> host move after it fills, so the drop (freeing buffers, no copy) finishes before that starts.
    """

    model: str
    src: Tier
    dst: Tier
    reason: str


@dataclass(frozen=True)
class Release(Move):
    """Not a move: a model on its device frees the page-locked host copy of its weights that its workers keep
    since it was last parked in host memory (``pipelines/hostcopy.py``; issue 27). Cheap (an unpin and a free, no
    copy); the model stays where it is and serves meanwhile, and its next move to host memory builds the copy
    again, slower that once. Carried with the drops out of host memory, before the copies that need its room.
    ``src`` and ``dst`` are both "device": its weights stay where they are."""


@dataclass(frozen=True)
class Fits:
    """The job may run now; if ``load_from`` is set, after loading the model from that tier."""

    model: str
    load_from: Tier | None
    reason: str


@dataclass(frozen=True)
class Evict:
    """Make room first: start these moves, in order, then ask ``plan`` again once they are done."""

    model: str
    moves: tuple[Move, ...]
    reason: str


@dataclass(frozen=True)
class Wait:
    """Nothing to do now; ask again after the next transition. ``stage`` is what the job reports meanwhile."""

    model: str
    stage: str
    reason: str
    short: tuple[str, ...] = ()  # waiting for memory: the devices short of it (whom a turn may send away)


@dataclass(frozen=True)
class TooLarge:
    """The job can never run within the budget: refuse it at admission (``reason`` is the message)."""

    model: str
    need: int
    budget: int
    hints: tuple[str, ...]
    reason: str
    code: str = MODEL_TOO_LARGE
    device: str = ""  # where it does not fit (a model on several devices: the first that refuses it)


Plan = Fits | Evict | Wait | TooLarge


@dataclass(frozen=True)
class Pressure:
    """Other programs took the device's memory: these idle models leave; ``waiting`` if that is not enough."""

    device: str
    moves: tuple[Move, ...]
    waiting: bool
    reason: str


@dataclass(frozen=True)
class OomRetry:
    """First out-of-memory of a run: start these moves (idle models leave), empty the cache, run it again."""

    model: str
    moves: tuple[Move, ...]
    reason: str


@dataclass(frozen=True)
class OomSplit:
    """The retry failed too: run the batch as these two halves, each with ``attempt=2`` if it fails."""

    model: str
    halves: tuple[Shape, Shape]
    reason: str


@dataclass(frozen=True)
class OomFail:
    """Out of memory for good: fail this job (only this job) with ``code`` and ``reason`` as its message."""

    model: str
    reason: str
    code: str = OUT_OF_MEMORY


OomDecision = OomRetry | OomSplit | OomFail


def failed_load(reason: str) -> str:
    """A model's residency reason after its load failed (``GET /v1/models``' ``residency_reason``)."""
    return f"load failed: {reason}"


@dataclass(frozen=True)
class ModelStatus:
    """One model as ``GET /v1/models`` and ``diffusiond ps`` show it."""

    name: str
    device: str
    residency: Tier
    device_bytes: int
    host_bytes: int
    keep_alive_until: float | None  # None: not on the device, or kept there forever (``forever``)
    forever: bool
    pinned: bool
    queued: int
    running: int
    reason: str  # why it is where it is: the last transition's reason
    unload_pending: bool = False  # an unload by hand waits for its work (``byhand.unload``)
    per_device: dict[str, int] = field(default_factory=dict)  # device -> its share of ``device_bytes``
    kept_bytes: int = 0  # of ``host_bytes``, the host copy its workers keep beside it on its device (issue 27)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def reason_label(reason: str) -> str:
    """A bounded label for the evictions metric (the reason text itself is for the log)."""
    for word, label in (("max-model-wait", "max_model_wait"),
                        ("keep", "keep_alive"), ("room", "room"), ("hand", "by_hand"), ("pressure", "pressure"),
                        ("other programs", "pressure"), ("ran out of memory", "oom"), ("sleep", "sleep")):
        if word in reason:
            return label
    return "other"
