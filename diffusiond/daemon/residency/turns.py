"""Turns on a shared device: the model there keeps it while it has work, but no job of another model
waits behind it much longer than ``--max-model-wait``.

Why both halves. A move costs time (SDXL to host memory and back is about 0.4 s on the H200:
docs/benchmarks.md, "Residency moves"; and the batches in flight drain first), so the model on the
device is preferred: it serves its queue while another model's jobs wait, and a stream that
alternates between two models pays a move per queue drained instead of one per request. But the
policy never sends away a model with work (policy.py), so a model with a steady stream would keep
its device for ever and the other model's jobs would wait without bound. So once a job of a model
that cannot get onto its device (residency's last plan for it said wait for memory) has waited
longer than the bound, the model in its way is held: it takes no new batch, finishes those it runs,
and leaves the device (the keeper carries that out); it is not given batches again before the model
it yields to runs. That model's turn then lasts at least the bound too (while it has work), so two
models with steady streams take turns of about the bound each rather than swapping at every batch.

A model on several devices (a worker on each) takes turns on each of them: it is in the way of a model waiting
for any device it uses, and waits for any model on one of its own that is short of memory for it.

Pure, as policy.py is: the keeper passes every model's standing and the time, and carries out what
comes back; each hold, and each end of one, carries the reason the log gives.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from diffusiond.daemon.residency.decisions import Tier


@dataclass(frozen=True)
class Standing:
    """One model as the turns see it at a dispatch."""

    name: str
    device: str
    tier: Tier
    pinned: bool
    moving: bool  # a move of it (a load, or leaving its device) is under way
    running: bool  # a batch of it is on a worker
    oldest: float | None  # when its longest-waiting queued output was admitted (monotonic s); None: none queued
    blocked: bool  # residency's last plan for it said wait for memory: other models hold its device
    devices: tuple[str, ...] = ()  # every device it has a worker on (``device`` is the first); () : ``device`` alone
    short: tuple[str, ...] = ()  # blocked: the devices its last plan found short of memory; () : any it is on

    @property
    def on(self) -> tuple[str, ...]:
        return self.devices or (self.device,)

    @property
    def lacks(self) -> tuple[str, ...]:
        """Where a model in its way frees what it waits for: one on another of its devices would leave for nothing."""
        return tuple(d for d in self.on if d in self.short) or self.on


@dataclass(frozen=True)
class Hold:
    """``model`` takes no new batch and leaves its device once its batches are done: ``for_model``'s turn."""

    model: str
    for_model: str
    device: str
    since: float
    reason: str


@dataclass(frozen=True)
class Ended:
    hold: Hold
    reason: str


class Turns:
    def __init__(self, max_wait_s: float) -> None:
        """``max_wait_s``: how long a job may wait behind another model's before that model yields its
        device; 0 lets a waiting model in at its first dispatch, ``math.inf`` never holds anyone."""
        if math.isnan(max_wait_s) or max_wait_s < 0:
            raise ValueError(f"the longest wait behind another model must not be negative, got {max_wait_s}")
        self.max_wait_s = max_wait_s
        self.holds: dict[str, Hold] = {}  # held model -> its hold
        self.turns: dict[str, float] = {}  # model -> when the turn it was given (or a failed move's pause) began

    def held(self, name: str) -> Hold | None:
        return self.holds.get(name)

    def review(self, models: Iterable[Standing], now: float) -> tuple[list[Hold], list[Ended]]:
        """At a dispatch: the holds that end (the model they yield to runs, or has nothing left to wait
        for), then those that begin (a job waited past the bound). Ends first, because an end decides who
        may be held next: the model whose turn begins keeps its device for the bound."""
        by = {m.name: m for m in models}
        ended = []
        for hold in list(self.holds.values()):
            why = self._over(hold, by)
            if why is not None:
                del self.holds[hold.model]
                ended.append(Ended(hold, why))
                if hold.for_model in by and by[hold.for_model].running:
                    self.turns[hold.for_model] = now
        for name, began in list(self.turns.items()):
            m = by.get(name)
            if m is None or now - began >= self.max_wait_s or (m.oldest is None and not m.running):
                del self.turns[name]
        if not math.isfinite(self.max_wait_s):
            return [], ended
        # a held model waits for no turn of its own, and one that is owed a turn yields to no one: no cycles
        starving = sorted((m for m in by.values() if self._starving(m, now) and m.name not in self.holds),
                          key=lambda m: (m.oldest, m.name))
        waiting = {m.name for m in starving} | {h.for_model for h in self.holds.values()}
        begun = []
        for w in starving:
            mine = [by[h.model] for h in self.holds.values() if h.for_model == w.name and h.model in by]
            if any(m.tier == "device" for m in mine):
                continue  # one is still on its way out: see what that frees before holding another
            blockers = [m for m in by.values() if set(m.on) & set(w.lacks) and m.name != w.name and m.tier == "device"
                        and not m.pinned and not m.moving and (m.running or m.oldest is not None)
                        and m.name not in self.holds and m.name not in self.turns and m.name not in waiting]
            if not blockers:
                continue
            # the one whose own jobs have waited least pays the least for yielding (one with none queued, nothing)
            b = min(blockers, key=lambda m: (0.0 if m.oldest is None else now - m.oldest, m.name))
            assert w.oldest is not None
            device = next(d for d in w.lacks if d in b.on)  # the first device w lacks that the blocker holds
            reason = (f"a job of {w.name} has waited {now - w.oldest:.1f} s for {device}, longer than "
                      f"--max-model-wait {self.max_wait_s:g} s: {b.name} takes no new batch, finishes those it "
                      f"runs and yields the device to {w.name}")
            hold = Hold(b.name, w.name, device, now, reason)
            self.holds[b.name] = hold
            begun.append(hold)
        return begun, ended

    def _starving(self, m: Standing, now: float) -> bool:
        return (m.oldest is not None and m.blocked and not m.running and not m.moving
                and now - m.oldest > self.max_wait_s)

    @staticmethod
    def _over(hold: Hold, by: dict[str, Standing]) -> str | None:
        w = by.get(hold.for_model)
        if w is None or hold.model not in by:
            return f"{hold.for_model if w is None else hold.model} is no longer served"
        if w.running:
            return f"{w.name} runs on {hold.device}: its turn has begun"
        if w.oldest is None:
            return f"{w.name} has no job waiting any more"
        return None

    def release(self, name: str, reason: str, now: float) -> Ended | None:
        """A held model's move failed: it takes batches again, and is not held again for the bound (so a
        move that keeps failing is not tried at every dispatch)."""
        hold = self.holds.pop(name, None)
        if hold is None:
            return None
        self.turns[name] = now
        return Ended(hold, reason)

    def release_for(self, name: str, reason: str) -> list[Ended]:
        """``name``'s load failed: those that yield to it take batches again (it may load again later)."""
        ended = [Ended(h, reason) for h in self.holds.values() if h.for_model == name]
        for e in ended:
            del self.holds[e.hold.model]
        return ended

    def next_check(self, models: Iterable[Standing], now: float) -> float | None:
        """When ``review`` may next have a hold to begin with nothing else happening (for the engine's
        timer): a waiting model's job passing the bound, or a turn given ending."""
        if not math.isfinite(self.max_wait_s):
            return None
        due = [m.oldest + self.max_wait_s for m in models if m.oldest is not None and m.blocked]
        due += [began + self.max_wait_s for began in self.turns.values()]
        return min((t for t in due if t > now), default=None)
