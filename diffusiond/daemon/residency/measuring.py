"""Working memory as the engine hands it to residency: a worker's measurement of a run, the state dir's record of the
last run's at start, and what ``GET /v1/models`` shows of them.

Functions of the keeper (``keeper.py`` keeps a one-line method for each) over the policy's ``Measurements``
(``working.py``), split off it as ``byhand.py`` and ``leaving.py`` are.
"""

from __future__ import annotations

import logging
from typing import Any

from diffusiond.daemon.residency.policy import Residency
from diffusiond.daemon.residency.working import Shape
from diffusiond.daemon.workers.pool import Model

log = logging.getLogger("diffusiond.daemon.residency.keeper")  # one logger for residency


def measured(policy: Residency, name: str, shape: Shape, peak_bytes: int) -> dict[str, Any] | None:
    """A worker measured a run's working memory: later plans for the shape use it. Returns the model's
    measurements when they changed (a new shape, a larger peak), for the engine to keep in the state
    dir; None when they did not, so a steady stream of batches writes nothing."""
    if not policy.has(name):
        return None
    measurements = policy.measurements
    before = measurements.entry(name)
    policy.measured(name, shape, peak_bytes)
    after = measurements.entry(name)
    return after if after != before else None


def remembered(policy: Residency, entries: dict[str, Any]) -> None:
    """At start, the measurements the last run kept (model name -> ``Measurements.entry``), so the first
    plans use them; one that does not read is logged and measured again."""
    for name, entry in entries.items():
        try:
            policy.measurements.load(name, entry)
        except ValueError as exc:
            log.warning("%s; it is measured again as it runs", exc)


def working(policy: Residency, model: Model) -> dict[str, int]:
    """The model's measured working bytes per shape key (``WxHxBATCHxFRAMES``), for its weights now."""
    peaks = policy.measurements.peaks(model.name, model.capabilities.weight_bytes)
    return {s.key: p for s, p in sorted(peaks.items())}
