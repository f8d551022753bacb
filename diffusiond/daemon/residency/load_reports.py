"""How far each model's load is, from its workers' LOAD_PROGRESS frames (issue 27's ``loading.bytes_loaded``).

A worker reads a model component by component and reports the bytes read so far after each one
(``pipelines/load_progress.py``). What counts is the report of a worker that loads or has just loaded (the
job still waits while the move ends); a sleeping worker's weights are off the device, and a stopped one's
are gone, so their figures are forgotten at the model's next report. A model started on several devices
shows its furthest worker: the job runs on whichever is ready first.
"""

from __future__ import annotations

from diffusiond.daemon.workers.pool import Model
from diffusiond.protocol import WorkerState

_COUNTED = (WorkerState.STARTING, WorkerState.READY)


class LoadReports:
    def __init__(self) -> None:
        self._reports: dict[str, dict[int, int]] = {}  # model -> worker id -> bytes it has read

    def record(self, model: Model, worker_id: int, nbytes: int) -> None:
        counted = {w.id for w in model.workers if w.state in _COUNTED}
        reports = {**self._reports.get(model.name, {}), worker_id: nbytes}
        self._reports[model.name] = {w: n for w, n in reports.items() if w in counted}

    def so_far(self, model: Model, total: int | None) -> int | None:
        """The bytes read so far, never above ``total`` (the size it had when last counted); None before a
        report, and for a wake from host memory (one copy per tensor and one wait: nothing to report between)."""
        reports = self._reports.get(model.name, {})
        done = [reports[w.id] for w in model.workers if w.state in _COUNTED and w.id in reports]
        return min(max(done), total or max(done)) if done else None
