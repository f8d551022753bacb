"""The room's decisions and its bookkeeping: what is loaded where, within which budget, until when.

Two kinds of method, kept apart so a test can ask "what would happen" without anything happening:

- queries (``plan``, ``expired``, ``pressure``, ``on_oom``, ``evict``, ``preload``, ``snapshot``) read the
  state and return a decision (``decisions.py``) with its reason; they change nothing;
- reports (``queue``/``start``/``finish``, ``loading_started``/``loaded``/``load_failed``,
  ``unloading``/``unloaded``/``unload_failed``, ``worker_died``, ``measured``) tell the room what the
  engine did or saw, and are the only writers of the state.

The engine starts each move it is handed (``unloading``) before it asks again, and a job is queued
(``queue``) from admission on, so a model with work is never chosen to leave. Memory held is counted
until a worker says it is free: a model on its way out still counts, so two plans never spend the
same bytes. Time is passed in, never read, so every rule can be tested step by step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import diffusiond.daemon.residency.host_memory as host_memory
from diffusiond.daemon.residency.decisions import (
    LOADING,
    WAITING_FOR_MEMORY,
    Evict,
    Fits,
    ModelStatus,
    Move,
    OomDecision,
    OomRetry,
    OomSplit,
    Plan,
    Pressure,
    Release,
    Tier,
    Wait,
    failed_load,
)
from diffusiond.daemon.residency.entry import ModelEntry
from diffusiond.daemon.residency.too_large import out_of_memory, too_large
from diffusiond.daemon.residency.units import FOREVER, format_bytes
from diffusiond.daemon.residency.working import Estimate, Measurements, Shape, default_working

DEFAULT_KEEP_ALIVE_S = 300.0


class ResidencyError(RuntimeError):
    """A report that contradicts the room's state (a bug in the caller): it names the model and both states."""


class Residency:
    """Budgets per device and in host memory, and every model's place within them."""

    def __init__(self, devices: Mapping[str, int], host_bytes: int, *, keep_alive_s: float = DEFAULT_KEEP_ALIVE_S,
                 max_keep_alive_s: float = FOREVER, measurements: Measurements | None = None,
                 working_default: Callable[[int, Shape], int] = default_working) -> None:
        """``devices``: device name -> bytes its models may use (weights and working memory together);
        ``host_bytes``: what weights may take in host memory off their devices. A device whose name
        starts with ``cpu`` has no host tier: its memory is host memory, so a model leaving it goes to disk."""
        for name, budget in {**devices, "host memory": host_bytes}.items():
            if budget < 0:
                raise ValueError(f"the budget of {name} is {budget} bytes; a budget cannot be negative")
        self.budgets = dict(devices)
        self.host_budget = host_bytes
        self.keep_alive_s = keep_alive_s
        self.max_keep_alive_s = max_keep_alive_s
        self.measurements = measurements or Measurements()
        self._working_default = working_default
        self._models: dict[str, ModelEntry] = {}
        self._headroom: dict[str, int] = {}  # device -> free minus reserve, as last measured and adjusted since

    # ---- models ------------------------------------------------------------------------------------------

    def add(self, name: str, devices: str | Sequence[str], weight_bytes: int, *, pinned: bool = False,
            keep_alive_s: float | None = None, hints: Sequence[str] = (), host_bytes: int = 0) -> None:
        """Register a configured model (on disk). ``devices``: one entry per worker (``--device cuda:0,cuda:1``,
        or ``cpu`` twice for two workers there), each holding a copy of the weights, all counted; ``hints``: what
        would make it fit, where it supports them (offloading, a quantized variant); ``keep_alive_s`` overrides
        the daemon's default for it; ``host_bytes``: what each worker keeps in host memory while on its device
        (``host_memory.py``)."""
        places = (devices,) if isinstance(devices, str) else tuple(devices)
        if name in self._models:
            raise ValueError(f"model {name!r} is already known to the residency room")
        for device in places or ("(none)",):
            if device not in self.budgets:
                raise ValueError(f"model {name!r}: device {device!r} has no budget "
                                 f"(devices: {', '.join(self.budgets)})")
        if min(weight_bytes, host_bytes) < 0:
            raise ValueError(f"model {name!r}: weight bytes {weight_bytes} or host bytes {host_bytes} is negative")
        self._models[name] = ModelEntry(name, places, weight_bytes, pinned, keep_alive_s, tuple(hints), host_bytes)

    def has(self, name: str) -> bool:
        return name in self._models

    def tier(self, name: str) -> Tier:
        return self._get(name).tier

    def queued(self, name: str) -> int:
        return self._get(name).queued

    def _get(self, name: str) -> ModelEntry:
        try:
            return self._models[name]
        except KeyError:
            raise ResidencyError(f"model {name!r} is not known to the residency room") from None

    def estimate(self, name: str, shape: Shape) -> Estimate:
        m = self._get(name)
        est = self.measurements.estimate(name, m.weight_bytes, shape)
        if est.measured:
            return est
        return Estimate(self._working_default(m.weight_bytes, shape), False, est.how)

    # ---- accounting --------------------------------------------------------------------------------------

    def device_used(self, device: str) -> int:
        """Bytes the room counts as held on ``device``: resident weights plus running jobs' working memory, and the
        copies of lost workers whose replacements come up."""
        return sum(m.booked(device) for m in self._models.values())

    def host_used(self) -> int:
        return host_memory.used(self._models.values())

    def kept(self, name: str) -> int:
        """The page-locked host copy its workers keep beside it on its device (issue 27); 0 elsewhere: in host
        memory that copy holds its weights (``host_bytes``), on disk its workers, and the copy, are gone."""
        m = self._get(name)
        return m.kept if m.tier == "device" else 0

    def free(self, device: str) -> int:
        """What a run may take on ``device`` now: its budget less what the books hold, within what other programs
        leave (``pressure``)."""
        free = self.budgets[device] - self.device_used(device)
        return min(free, self._headroom[device]) if device in self._headroom else free

    def running_on(self, name: str, device: str) -> int:
        """What ``name``'s runs hold on ``device``."""
        return sum(r for _, r, _, d in self._get(name).running if d == device)

    def _leaving_bytes(self, device: str) -> int:
        return sum(m.frees(device) for m in self._models.values()
                   if m.leaving is not None and m.leaving.src == "device")

    def _idle_on(self, devices: Sequence[str], but: str = "") -> list[ModelEntry]:
        """Who may leave any of ``devices`` to make room: idle, not pinned, not already leaving; least recent first."""
        found = [m for m in self._models.values() if set(m.devices) & set(devices) and m.tier == "device"
                 and m.idle and not m.pinned and m.leaving is None and m.name != but]
        return sorted(found, key=lambda m: (m.last_used, m.name))

    def _moves_off_device(self, leaving: Iterable[ModelEntry], reason: str) -> tuple[Move, ...]:
        return host_memory.moves_off_device(self._models.values(), leaving, self.host_budget, reason)

    # ---- queries -----------------------------------------------------------------------------------------

    def plan(self, name: str, shape: Shape | None) -> Plan:
        """Can a job of ``shape`` (None: only the weights, for a load by hand or a preload) run now? A model
        on several devices needs its weights on each (once per worker there) and room for the run on each
        (the worker that takes it is not known yet); messages name the device where it is shortest."""
        m = self._get(name)
        est = self.estimate(name, shape) if shape is not None else Estimate(0, True, "no run yet")
        known = est.floor  # only what a run proved refuses a job; a guess never does (the OOM path corrects it)
        for d in m.places:
            pinned = [p for p in self._models.values()
                      if d in p.devices and p.pinned and p.resident and p.name != name]
            if m.size(d) + known > self.budgets[d] - sum(p.size(d) for p in pinned):
                return too_large(m, d, self.budgets[d], shape, known, est, pinned)
        if m.tier == "loading":
            return Wait(name, LOADING, f"{name} is loading onto {m.where}")
        if m.leaving is not None:
            return Wait(name, LOADING, f"{name} is leaving {m.where} ({m.leaving.reason}); "
                                       "it can be loaded again once it has")
        load_from = None if m.tier == "device" else m.tier
        weights = 0 if load_from is None else m.weight_bytes
        need = {d: weights * m.devices.count(d) + est.nbytes for d in m.places}
        free = {d: self.free(d) for d in m.places}
        soon = {d: free[d] + self._leaving_bytes(d) for d in m.places}
        dev = min(m.places, key=lambda d: (free[d] - need[d], m.places.index(d)))  # the shortest, for messages
        lacking = tuple(d for d in m.places if need[d] > free[d])  # where a turn may send a model away
        what = f"{format_bytes(need[dev])} ({'weights and ' if weights else ''}{est.how})"
        if all(need[d] <= free[d] for d in m.places):
            return self._fits(m, load_from, f"{what} fits in the {format_bytes(free[dev])} free on {dev}")
        if all(need[d] <= soon[d] for d in m.places):
            return Wait(name, WAITING_FOR_MEMORY, f"{name} needs {what}: waiting for models leaving {dev}",
                        short=lacking)
        # who frees something where it is short: on several devices, one with room keeps its models
        idle = [c for c in self._idle_on(m.places, but=name)
                if any(c.frees(d) for d in m.places if soon[d] < need[d])]
        picked, room = [], dict(soon)
        for c in idle:
            if all(room[d] >= need[d] for d in m.places):
                break
            if not any(c.frees(d) for d in m.places if room[d] < need[d]):
                continue  # the devices it would free have room now
            picked.append(c)
            room = {d: room[d] + c.frees(d) for d in m.places}
        if all(room[d] >= need[d] for d in m.places):
            return Evict(name, self._moves_off_device(picked, f"making room for {name} on {dev}"),
                         f"{name} needs {what}; {format_bytes(free[dev])} free on {dev}")
        others = [o for o in self._models.values() if set(o.devices) & set(m.places) and o.name != name]
        # its own runs too: when they end, their working memory is back, so no standstill is to be broken meanwhile
        running = sorted(o.name for o in (*others, m) if o.running)
        if running:
            return Wait(name, WAITING_FOR_MEMORY, f"{name} needs {what} and {dev} has {format_bytes(free[dev])} "
                                                  f"free: waiting for the runs of {', '.join(running)}", short=lacking)
        floor = {d: weights * m.devices.count(d) + known for d in m.places}  # the least it could run in
        room = {d: soon[d] + sum(c.frees(d) for c in idle) for d in m.places}
        if all(floor[d] <= room[d] for d in m.places):
            if idle:
                return Evict(name, self._moves_off_device(idle, f"making room for {name} on {dev}"),
                             f"{name} needs {what}, more than {dev} can free: clearing it and trying")
            if all(floor[d] <= free[d] for d in m.places):
                return self._fits(m, load_from, f"{name} needs {what}, more than {dev} can free: trying it "
                                                f"on the {format_bytes(free[dev])} free")
            return Wait(name, WAITING_FOR_MEMORY, f"{name} needs {format_bytes(floor[dev])}: waiting for models "
                                                  f"leaving {dev}", short=lacking)
        if not any(self._leaving_bytes(d) for d in m.places):
            # A standstill: nothing runs, and the memory is held by models whose queued jobs cannot start
            # either (their smallest measured run does not fit); each would wait for the others forever.
            # The least recently used of them leave; their jobs wait to load again.
            spare = min(free[d] + sum(c.frees(d) for c in idle) for d in m.places)
            stuck = sorted((o for o in others if o.tier == "device" and o.queued and not o.pinned
                            and o.leaving is None and self._least_run(o) > spare),
                           key=lambda o: (o.last_used, o.name))
            for c in stuck:
                if all(room[d] >= floor[d] for d in m.places):
                    break
                idle.append(c)
                room = {d: room[d] + c.frees(d) for d in m.places}
            if all(room[d] >= floor[d] for d in m.places):
                return Evict(name, self._moves_off_device(idle, f"making room for {name} on {dev}, where "
                                                                "nothing runs and queued models hold the memory"),
                             f"{name} needs {what}: a standstill of queued models on {dev} is broken")
        short = f"{name} needs {what} and {dev} has {format_bytes(max(free[dev], 0))} free"
        if dev in self._headroom:
            short += f" (other programs leave {format_bytes(max(self._headroom[dev], 0))} beyond the reserve)"
        return Wait(name, WAITING_FOR_MEMORY, short + ": waiting for memory", short=lacking)

    def _fits(self, m: ModelEntry, load_from: Tier | None, reason: str) -> Fits | Evict | Wait:
        return host_memory.fits(self._models.values(), m, load_from, self.host_budget, reason)

    def _least_run(self, m: ModelEntry) -> int:
        """A lower bound of the working memory of any run of ``m``: its smallest measured peak (or 0)."""
        return min(self.measurements.peaks(m.name, m.weight_bytes).values(), default=0)

    def expired(self, now: float) -> tuple[Move, ...]:
        """Models whose keep-alive has run out: off the device, soonest deadline first."""
        due = sorted((m for m in self._models.values() if m.tier == "device" and m.idle and not m.pinned
                      and m.leaving is None and m.deadline <= now), key=lambda m: (m.deadline, m.name))
        return self._moves_off_device(due, "keep_alive expired")

    def next_expiry(self) -> float | None:
        """When ``expired`` will next have something to say (for the engine's timer), if ever."""
        deadlines = [m.deadline for m in self._models.values() if m.tier == "device" and m.idle
                     and not m.pinned and m.leaving is None and m.deadline != FOREVER]
        return min(deadlines, default=None)

    def pressure(self, device: str, free_bytes: int, reserve_bytes: int) -> Pressure:
        """The device's real free memory, measured (NVML): keep ``reserve_bytes`` of it free for other
        programs by sending idle models away. Also remembered: ``plan`` spends no more than it leaves."""
        if device not in self.budgets:
            raise ResidencyError(f"device {device!r} has no budget (devices: {', '.join(self.budgets)})")
        # moves under way are counted since booked, and may not show in the reading yet (a load's workers starting,
        # a leaving model's stopping): left out, so each is counted once
        self._headroom[device] = free_bytes - reserve_bytes - sum(
            m.frees(device) for m in self._models.values() if m.tier == "loading"
            or (m.leaving is not None and m.leaving.src == "device"))
        deficit = reserve_bytes - free_bytes - self._leaving_bytes(device)
        state = f"{format_bytes(free_bytes)} free on {device}, reserve {format_bytes(reserve_bytes)}"
        if deficit <= 0:
            return Pressure(device, (), False, f"{state}: nothing to do")
        picked = []
        for c in self._idle_on((device,)):
            if deficit <= 0:
                break
            picked.append(c)
            deficit -= c.frees(device)
        moves = self._moves_off_device(picked, f"other programs need the memory: {state}")
        if deficit > 0:
            return Pressure(device, moves, True, f"{state}: {format_bytes(deficit)} short even with every idle "
                                                 "model gone; new jobs wait for memory")
        return Pressure(device, moves, False, f"{state}: {len(picked)} idle model(s) leave")

    def on_oom(self, name: str, shape: Shape, attempt: int, device: str | None = None) -> OomDecision:
        """A run of ``shape`` ran out of device memory on ``device`` (None: any of the model's); ``attempt`` 0 for
        its first run, 1 for the retry, 2 for a half of a split batch. Only the job pays: the worker and the other
        models go on, those idle on the model's other devices too."""
        m = self._get(name)
        if attempt == 0:
            idle = self._idle_on((device,) if device in m.places else m.places, but=name)
            return OomRetry(name, self._moves_off_device(idle, f"{name} ran out of memory at {shape}"),
                            f"out of memory at {shape}: {len(idle)} idle model(s) leave, then it runs again")
        if attempt == 1 and shape.batch > 1:
            return OomSplit(name, shape.halves(), f"out of memory again at {shape}: running it as two halves")
        return out_of_memory(m, shape, attempt, self.estimate(name, shape), self.budgets[m.device])

    def evict(self, name: str, reason: str, *, queued_ok: bool = False) -> Evict | Wait:
        """By hand (``unload``, ``sleep``): off the device even if pinned, or out of host memory; not while it has
        work, which would only load it again (but ``queued_ok``: its jobs wait for another model's turn, turns.py)."""
        m = self._get(name)
        if m.running or (m.queued and not queued_ok):
            return Wait(name, WAITING_FOR_MEMORY, f"{name} has {m.queued} job(s) queued and {len(m.running)} "
                                                  "running; it can leave once they are done")
        if m.leaving is not None or m.tier == "loading":
            return Wait(name, LOADING, f"{name} is {'leaving' if m.leaving else 'loading'}; ask again after")
        if m.tier == "device":
            return Evict(name, self._moves_off_device([m], reason), reason)
        moves = (Move(name, "host", "disk", reason),) if m.tier == "host" else ()
        return Evict(name, moves, reason)

    def preload(self, names: Sequence[str]) -> list[str]:
        """Of ``names`` (in the order configured), those whose weights fit together in their budgets."""
        free = {d: self.free(d) for d in self.budgets}
        chosen = []
        for name in names:
            m = self._get(name)
            if m.tier in ("device", "loading") or m.leaving is not None:
                continue
            if all(m.frees(d) <= free[d] for d in m.places):
                free = {d: free[d] - m.frees(d) for d in free}
                chosen.append(name)
        return chosen

    def snapshot(self) -> list[ModelStatus]:
        return [m.status(host_memory.held(m), self.kept(m.name)) for m in sorted(self._models.values(),
                                                                                  key=lambda m: m.name)]

    # ---- reports: jobs -----------------------------------------------------------------------------------

    def keep_alive_for(self, name: str, requested_s: float | None) -> float:
        """A request's keep-alive, capped by ``max_keep_alive_s``; None: the model's, else the daemon's."""
        m = self._get(name)
        if requested_s is None:
            return m.keep_alive_s if m.keep_alive_s is not None else self.keep_alive_s
        if requested_s < 0:
            raise ValueError(f"keep_alive {requested_s} s is negative; use units.FOREVER for forever")
        return min(requested_s, self.max_keep_alive_s)

    def touch(self, name: str, keep_alive_s: float | None, now: float) -> None:
        """A job used the model: its keep-alive timer starts again from ``now``."""
        m = self._get(name)
        keep = self.keep_alive_for(name, keep_alive_s)
        m.last_used = now
        m.deadline = FOREVER if keep == FOREVER else now + keep

    def queue(self, name: str, jobs: int = 1) -> None:
        """Jobs admitted for the model: from now on it has work and is never chosen to leave."""
        self._get(name).queued += jobs

    def unqueue(self, name: str, jobs: int = 1) -> None:
        """Queued jobs that ended before they ran (cancelled, failed, refused)."""
        m = self._get(name)
        if jobs > m.queued:
            raise ResidencyError(f"{name}: {jobs} job(s) leave the queue but only {m.queued} are queued")
        m.queued -= jobs

    def start(self, name: str, shape: Shape, now: float, jobs: int = 1, device: str | None = None) -> None:
        """A batch of ``jobs`` queued jobs starts as one run of ``shape`` on ``device`` (its worker's; None: the
        model's first); its working memory is reserved there."""
        m = self._get(name)
        device = device if device in m.places else m.device
        if m.tier != "device" or m.leaving is not None:
            raise ResidencyError(f"{name}: a run starts but the model is {m.tier}"
                                 f"{' and leaving' if m.leaving else ''}, not on {m.device}")
        self.unqueue(name, jobs)
        # a run tried on less than its estimate (a guess, or memory taken since its plan) holds what was free
        reserved = min(self.estimate(name, shape).nbytes, max(self.free(device), 0))
        m.running.append((shape, reserved, jobs, device))
        m.last_used = now
        self._adjust(device, -reserved)

    def finish(self, name: str, shape: Shape, now: float, jobs: int = 1, keep_alive_s: float | None = None,
               device: str | None = None) -> None:
        """The run ended (done, failed or cancelled): its memory is free and the keep-alive starts over."""
        m = self._get(name)
        for i, (s, reserved, n, d) in enumerate(m.running):
            if s == shape and n == jobs and device in (None, d):
                del m.running[i]
                self._adjust(d, reserved)
                break
        else:
            raise ResidencyError(f"{name}: a run of {shape} ({jobs} job(s)) finished that was not running")
        self.touch(name, keep_alive_s, now)

    def measured(self, name: str, shape: Shape, peak_bytes: int) -> dict[str, Any] | None:
        """A worker's peak for a run, above the weights: later plans for the shape use it. Returns the model's
        measurements where they changed, for the state dir to keep; None where not, or the model is not known."""
        if self.has(name) and self.measurements.record(name, self._get(name).weight_bytes, shape, peak_bytes):
            return self.measurements.entry(name)
        return None

    # ---- reports: moves ----------------------------------------------------------------------------------

    def _adjust(self, device: str, delta: int) -> None:
        if device in self._headroom:
            self._headroom[device] += delta

    def _adjust_weights(self, m: ModelEntry, sign: int) -> None:
        for d in m.places:
            self._adjust(d, sign * m.frees(d))

    def loading_started(self, name: str) -> None:
        m = self._get(name)
        if m.tier not in ("host", "disk") or m.leaving is not None:
            raise ResidencyError(f"{name}: a load starts but the model is {m.tier}, not in host memory or on disk")
        m.loading_from, m.tier, m.reason = m.tier, "loading", f"loading from {m.tier}"
        m.kept = m.kept if m.loading_from == "host" else 0  # new workers from disk have made no copy yet
        self._adjust_weights(m, -1)

    def loaded(self, name: str, now: float) -> None:
        """On the device; its keep-alive counts from now, so a preloaded model nobody uses leaves in time."""
        m = self._get(name)
        if m.tier != "loading":
            raise ResidencyError(f"{name}: loaded, but it was {m.tier}, not loading")
        m.tier, m.loading_from, m.reason = "device", None, f"loaded onto {m.where}"
        self.touch(name, None, now)

    def load_failed(self, name: str, reason: str) -> None:
        m = self._get(name)
        if m.tier != "loading":
            raise ResidencyError(f"{name}: a load failed, but it was {m.tier}, not loading")
        m.tier, m.loading_from, m.reason = "disk", None, failed_load(reason)
        self._adjust_weights(m, 1)

    def unloading(self, move: Move) -> None:
        """The engine started ``move``; the bytes stay counted where they were until ``unloaded``."""
        m = self._get(move.model)
        if isinstance(move, Release) and m.tier == "device" and m.releasing is None:
            m.releasing = move  # it stays, and serves: only its kept host copy goes
            return
        if m.tier != move.src or m.leaving is not None or isinstance(move, Release):
            raise ResidencyError(f"{move.model}: a move {move.src} -> {move.dst} starts but the model is {m.tier}"
                                 f"{' and already leaving' if m.leaving else ''}")
        if move.src == "device" and m.running:  # no decision sends away a model under a run
            raise ResidencyError(f"{move.model}: a move off {m.where} starts under {len(m.running)} run(s)")
        m.leaving = move

    def unloaded(self, move: Move) -> None:
        m = self._get(move.model)
        if isinstance(move, Release) and m.releasing == move:
            m.releasing, m.kept = None, 0
            return
        if m.leaving != move:
            raise ResidencyError(f"{move.model}: a move {move.src} -> {move.dst} finished that had not started")
        m.tier, m.leaving, m.reason = move.dst, None, move.reason
        m.kept = m.kept if move.dst == "host" else 0  # its workers stopped: their copies went with them
        if move.src == "device":
            self._adjust_weights(m, 1)
            m.lost = []  # off its device each worker counts again: a replacement comes up to join it there

    def unload_failed(self, move: Move, reason: str) -> None:
        """The move did not happen; the model stays where it was (a dead worker is ``worker_died``'s)."""
        m = self._get(move.model)
        if isinstance(move, Release) and m.releasing == move:
            m.releasing = None
            return
        if m.leaving != move:
            raise ResidencyError(f"{move.model}: a move {move.src} -> {move.dst} failed that had not started")
        m.leaving, m.reason = None, f"{move.src} -> {move.dst} failed: {reason}"

    def worker_died(self, name: str, device: str, reason: str, kept: int = 0) -> None:
        """A worker of ``name`` on ``device`` ended, with what it held there and in its host buffers (``kept``).
        While others of the model serve on, only its copy leaves (``ModelEntry.lose``); the last
        one takes the model back to disk, and its runs with it (the engine fails their jobs). Jobs still queued
        stay queued for the next worker."""
        m = self._get(name)
        if m.lose(device, kept, reason):
            self._adjust(device, m.weight_bytes)
            return
        freed = {d: m.on(d) for d in m.places}
        during = " during its load" if m.tier == "loading" else ""
        m.tier, m.loading_from, m.leaving, m.running, m.kept, m.releasing = "disk", None, None, [], 0, None
        m.reason, m.lost = f"worker died{during}: {reason}", []
        for d, nbytes in freed.items():
            self._adjust(d, nbytes)

    def worker_back(self, name: str, device: str) -> None:
        """A worker of ``name`` came up on ``device``: where it replaces a lost one, its copy is counted again."""
        m = self._get(name)
        if m.rejoin(device):
            self._adjust(device, -m.weight_bytes)

    def keeps(self, name: str, nbytes: int) -> None:
        """What its workers said they keep of page-locked host copies of its weights (``host_memory.py``)."""
        if nbytes < 0:
            raise ValueError(f"model {name!r}: kept host bytes {nbytes} is negative")
        self._get(name).kept = nbytes

    def resize(self, name: str, weight_bytes: int, host_bytes: int = 0) -> int:
        """The worker's count of a model placed by its files' headers (an estimate) before it loaded; returns the
        count it replaces."""
        m = self._get(name)
        before = m.weight_bytes
        if m.resident:
            for d in m.places:
                self._adjust(d, (m.weight_bytes - weight_bytes) * (m.devices.count(d) - m.lost.count(d)))
        m.weight_bytes, m.host_bytes = weight_bytes, host_bytes
        return before
