"""Residency: the one room that decides which model is where (on its device, in host memory, only on
disk), within which budget and until when, like Ollama's scheduler.

A workstation's GPU is shared with games, training runs and the desktop, so the daemon cannot hold every
model for as long as it runs. Every choice that follows from that (load on demand, keep a model for its
keep-alive, evict the idle least recently used, keep a reserve for other programs, retry after running out
of memory) is decided here, and each comes back as a decision that carries its reason, so the engine can log
why a model moved and tests can check every rule step by step.

Deciding, without torch, clocks or any I/O but reading weight files' headers:

- ``policy``: ``Residency``, the budgets and every model's state, and the rules; ``decisions``: its answers;
- ``turns``: how long a model keeps a shared device while another's jobs wait (``--max-model-wait``);
- ``preload``: which models the start loads;
- ``units``: sizes and durations as flags, TOML and requests write them;
- ``sizes``, ``gguf_header``: a model's weight bytes from its files' headers, without reading a tensor;
- ``working``: working memory per shape, measured by workers and remembered in the state dir;
- ``fit``: which configurations (offload, quantization) of a model fit a device (``fit_command``:
  ``diffusiond fit``, which prints them).

Carrying it out: ``keeper`` (the engine's one door to the room: it starts the moves through the worker
pool), ``ondemand`` (the start's loads and a never-seen model's first), ``pressure`` (each GPU's real free
memory, through NVML).

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
