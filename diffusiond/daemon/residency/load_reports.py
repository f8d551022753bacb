"""How far each model's load is, from its workers' LOAD_PROGRESS frames (issue 27's ``loading.bytes_loaded``).

A worker reads a model component by component and reports the bytes read so far after each one
(``pipelines/load_progress.py``). What counts is the report of a worker that loads or has just loaded (the
job still waits while the move ends); a sleeping worker's weights are off the device, and a stopped one's
are gone, so their figures are forgotten at the model's next report. A model started on several devices
shows its furthest worker: the job runs on whichever is ready first.

The total is what the load reads, as those reports count it (``read_bytes``): for a resident model its weights
on the device (``weight_bytes``), for an offloaded one every component, most of which waits in host memory
(``host_bytes``): its device figure alone is one component or group, which the reports pass after the first.

A wake from host memory has no component to report after: it is one asynchronous copy per tensor and one wait,
and a wait per component to report would slow the move itself. The keeper says 0 as it begins and the total
once the copy is done (``waking``), so a job waiting for it shows 0 of N, then N of N, as for a load from disk.
"""

from __future__ import annotations

from diffusiond.daemon.workers.pool import Model
from diffusiond.ipc.messages import Capabilities
from diffusiond.protocol import WorkerState

_COUNTED = (WorkerState.STARTING, WorkerState.READY)


class LoadReports:
    def __init__(self) -> None:
        self._reports: dict[str, dict[int, int]] = {}  # model -> worker id -> bytes it has read
        self._waking: dict[str, int] = {}  # model -> bytes of its wake from host memory so far (0, then all)

    def record(self, model: Model, worker_id: int, nbytes: int) -> None:
        counted = {w.id for w in model.workers if w.state in _COUNTED}
        reports = {**self._reports.get(model.name, {}), worker_id: nbytes}
        self._reports[model.name] = {w: n for w, n in reports.items() if w in counted}

    def so_far(self, model: Model, total: int | None) -> int | None:
        """The bytes read so far, never above ``total`` (the size it had when last counted); None before a
        report. During a wake from host memory, what ``waking`` said."""
        if model.name in self._waking:
            woke = self._waking[model.name]
            return woke if total is None else min(woke, total)
        reports = self._reports.get(model.name, {})
        done = [reports[w.id] for w in model.workers if w.state in _COUNTED and w.id in reports]
        return min(max(done), total or max(done)) if done else None

    def waking(self, model: Model, nbytes: int | None) -> None:
        """``model``'s wake from host memory has moved ``nbytes`` (None: it has ended, moved or not)."""
        if nbytes is None:
            self._waking.pop(model.name, None)
        else:
            self._waking[model.name] = nbytes

    def total(self, model: Model) -> int | None:
        """What ``model``'s load reads, as its worker last counted it (remembered in the state dir); None for a
        model never loaded."""
        return read_bytes(model.capabilities) or None if model.known else None


def read_bytes(caps: Capabilities) -> int:
    """What a load of a model with ``caps`` reads, as its worker's reports count it. Offloaded under ``model``,
    ``group`` or ``sequential``, its host share is every component (``offload.host_bytes``), which is what the
    reports add up to; the device figure is a part of those, counted again. Under ``stream`` the host share
    leaves out the blocks kept on the device, so the device figure adds them back (and its few block buffers,
    which only makes the total a little larger than what is read: the figure never reads as done too soon).
    Modules kept beside an offloaded model (ControlNets, upscalers) are left out: they load after its
    components, and the worker's last report (its device figure, as READY counts it) is seldom above those."""
    if caps.offload in ("", "none") or not caps.host_bytes:
        return caps.weight_bytes
    if caps.offload == "stream":
        return caps.weight_bytes + caps.host_bytes
    return max(caps.weight_bytes, caps.host_bytes)
