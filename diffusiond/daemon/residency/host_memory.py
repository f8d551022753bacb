"""What each model holds in host memory, and who goes to disk to make room there (``Residency``'s host side).

A model in the host tier holds all of its weights there. An offloaded one (``offload=group``, ``model``,
``sequential``, ``stream``) holds most of them there while it is "on the device" too: its worker reports that
share at READY (``Capabilities.host_bytes``, ``pipelines/offload.host_bytes``), pinned for group and stream,
and FLUX under ``offload=group`` keeps about 34 GB so. Counting only the host tier let such models overcommit
``--host-memory`` by tens of GB; here every tier but disk counts what it holds, and a model on its way to the
host tier counts its whole size (its device share joins its host share). A model on several devices has a
worker per device, each with its own host copy: each counts. A model parked in host memory
once keeps its page-locked copy there when it goes back to its device (``pipelines/hostcopy.py``: later moves
reuse it), and counts it then (``ModelEntry.kept``, as its workers report it in their answers to SLEEP and
WAKE; issue 27).
"""

from __future__ import annotations

from collections.abc import Iterable

from diffusiond.daemon.residency.decisions import WAITING_FOR_MEMORY, Evict, Fits, Move, Release, Tier, Wait
from diffusiond.daemon.residency.entry import ModelEntry as _Model
from diffusiond.daemon.residency.units import format_bytes


def held(m: _Model) -> int:
    """Bytes ``m`` holds in host memory now, or has been promised there (a move or load under way): once per
    worker, each of which keeps its own copy."""
    workers = m.workers
    if m.tier == "host" or m.loading_from == "host" or (m.leaving is not None and m.leaving.dst == "host"):
        return (m.weight_bytes + m.host_bytes) * workers
    return m.host_bytes * workers + m.kept if m.tier in ("device", "loading") else 0


def used(models: Iterable[_Model]) -> int:
    return sum(held(m) for m in models)


def freeing(models: Iterable[_Model]) -> int:
    """Host memory on its way out: kept copies being released, and host-tier models on their way to disk. Room
    about to be free (as ``plan`` counts what leaves a device), so a second plan before their answers come back
    does not free more for the same need: it would drop another model to disk for nothing."""
    return sum(m.kept if m.releasing is not None else held(m) if m.leaving is not None and m.leaving.src == "host"
               else 0 for m in models)


def keepers(models: Iterable[_Model], but: Iterable[_Model] = ()) -> list[_Model]:
    """Models on their devices whose workers keep a host copy that may be freed (``decisions.Release``), oldest use
    first; not ``but`` (leaving for host memory, they copy into theirs), nor one on its way off its device."""
    skip = {m.name for m in but}
    return sorted((m for m in models if m.tier == "device" and m.kept and m.leaving is None and m.releasing is None
                   and m.name not in skip), key=lambda m: (m.last_used, m.name))


def _release(d: _Model, budget: int, why: str) -> Release:
    return Release(d.name, "device", "device", f"host memory is full ({format_bytes(budget)} budget) and {why}: "
                   f"{d.name}, on its device, frees the {format_bytes(d.kept)} copy of its weights it kept there")


def moves_off_device(models: Iterable[_Model], leaving: Iterable[_Model], budget: int,
                     reason: str) -> tuple[Move, ...]:
    """Device -> host for each of ``leaving``, making room in host memory first by freeing the copies models on
    their devices keep there (``keepers``: no copy, only a slower next move for them), then by dropping its least
    recently used models (older than the one arriving) to disk; a model that cannot have host room goes to disk
    itself. Arriving, a model adds its device share (``weight_bytes``): its host share is counted already, and
    so is the copy it kept (its weights go into it)."""
    everyone, leaving = list(models), list(leaving)
    moves: list[Move] = []
    free = budget - used(everyone) + freeing(everyone)
    releasable = keepers(everyone, but=leaving)
    droppable = sorted((m for m in everyone if m.tier == "host" and m.leaving is None and m.idle),
                       key=lambda m: (m.last_used, m.name))
    for m in leaving:
        arriving = max(m.weight_bytes * m.workers - m.kept, 0)
        if any(d.startswith("cpu") for d in m.devices) or not budget:
            moves.append(Move(m.name, "device", "disk", reason))
            continue
        while free < arriving and releasable:
            d = releasable.pop(0)
            moves.append(_release(d, budget, f"{m.name} leaves {m.where} for it"))
            free += d.kept
        while free < arriving and droppable and droppable[0].last_used <= m.last_used:
            d = droppable.pop(0)
            moves.append(Move(d.name, "host", "disk", f"host memory is full ({format_bytes(budget)}"
                              f" budget) and {d.name} is its least recently used model"))
            free += held(d)
        if free >= arriving:
            moves.append(Move(m.name, "device", "host", reason))
            free -= arriving
        else:
            moves.append(Move(m.name, "device", "disk", f"{reason}; no room for it in host memory "
                              f"({format_bytes(max(free, 0))} free of {format_bytes(budget)})"))
    return tuple(moves)


def fits(models: Iterable[_Model], m: _Model, load_from: Tier | None, budget: int, reason: str) -> Fits | Evict | Wait:
    """``m`` fits its devices: Fits once host memory has room for what it keeps there while on them (offloaded),
    made before its load from disk and after a first load that told its share (the files' headers give only the
    device's). A load from disk waits for the room being freed, as a copy into host memory does
    (``leaving.carry_booked``): begun at once, it read its weights while the dropped model's worker still held its
    own. A model on its device holds its share already, and waits for nothing; one in host memory holds all of it."""
    go = Fits(m.name, load_from, reason)
    everyone = list(models)
    need = m.host_bytes * len(m.devices)  # its share: a copy it keeps beside counts as held, not as a need
    free = budget - used(everyone) + (m.host_bytes * m.workers if m.tier in ("device", "loading") else 0)
    if load_from == "host" or not need or free >= need:
        return go
    why = f"{m.name} keeps {format_bytes(m.host_bytes)} in host memory while on {m.device} (offloaded)"
    if free + freeing(everyone) >= need:  # room once what is on its way out is out
        return Wait(m.name, WAITING_FOR_MEMORY, f"{why}: waiting for the models leaving host memory for it") \
            if load_from == "disk" else go
    drops = _drops(everyone, m, budget, need, free + freeing(everyone))
    # where no drop makes room enough, the load goes ahead all the same: a host budget never refuses a model
    return Evict(m.name, drops, f"{why}: making room there first") if drops else go


def _drops(everyone: list[_Model], m: _Model, budget: int, need: int, free: int) -> tuple[Move, ...]:
    """The moves that give ``m`` the ``need`` bytes of host memory it keeps while on its devices, ``free`` being
    free: the copies models on their devices keep there freed first (``keepers``), then the least recently used idle
    models of the host tier to disk; none where all of them together would not make room enough."""
    moves: list[Move] = []
    why = f"{m.name}, offloaded, keeps {format_bytes(m.host_bytes)} there while it runs"
    for d in keepers(everyone, but=[m]):
        if free >= need:
            break
        moves.append(_release(d, budget, why))
        free += d.kept
    for d in sorted((o for o in everyone if o.tier == "host" and o.leaving is None and o.idle and o is not m),
                    key=lambda o: (o.last_used, o.name)):
        if free >= need:
            break
        moves.append(Move(d.name, "host", "disk", f"host memory is full ({format_bytes(budget)} budget) and {why}"))
        free += held(d)
    return tuple(moves) if free >= need else ()
