"""Residency: the one room that decides which model is where (on its device, in host memory, only on
disk), within which budget and until when, like Ollama's scheduler.

A workstation's GPU is shared with games, training runs and the desktop, so the daemon cannot hold every
model for as long as it runs. Every choice that follows from that (load on demand, keep a model for its
keep-alive, evict the idle least recently used, keep a reserve for other programs, retry after running out
of memory) is made here, in process, without torch, clocks or any I/O but reading weight files' headers, and
each comes back as a decision that carries its reason, so the engine can log why a model moved and tests can
check every rule step by step.

- ``units``: sizes and durations as flags, TOML and requests write them;
- ``sizes``: a model's weight bytes from its safetensors headers, without reading a tensor;
- ``working``: working memory per shape, measured by workers and remembered in the state dir;
- ``decisions``: the decisions, as values;
- ``policy``: ``Residency``, the budgets and every model's state, and the rules.

What the engine needs is re-exported here: ``from diffusiond.daemon.residency import Residency, Shape``.
"""

from diffusiond.daemon.residency.decisions import (
    Evict,
    Fits,
    ModelStatus,
    Move,
    OomFail,
    OomRetry,
    OomSplit,
    Pressure,
    Tier,
    TooLarge,
    Wait,
)
from diffusiond.daemon.residency.policy import Residency, ResidencyError
from diffusiond.daemon.residency.sizes import ModelWeights, WeightsError, model_weights
from diffusiond.daemon.residency.units import FOREVER, Size, parse_duration, parse_size
from diffusiond.daemon.residency.working import Measurements, Shape

__all__ = ["FOREVER", "Evict", "Fits", "Measurements", "ModelStatus", "ModelWeights", "Move", "OomFail", "OomRetry",
           "OomSplit", "Pressure", "Residency", "ResidencyError", "Shape", "Size", "Tier", "TooLarge", "Wait",
           "WeightsError", "model_weights", "parse_duration", "parse_size"]
