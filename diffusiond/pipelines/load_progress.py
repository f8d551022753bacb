"""How far a model's load is, component by component, for jobs that wait in the stage ``loading`` (issue 27).

diffusers' ``from_pretrained`` and ``from_single_file`` read a pipeline's components one after another but
take no callback. Each component goes through one module-level function of diffusers (``load_sub_model``,
``load_single_file_sub_model``), looked up when it is called; those two are wrapped once, and the wrapper
only passes through, except in a thread inside ``reporting``: there each component loaded adds its weight
bytes (parameters and buffers, counted as ``base.weight_bytes`` counts a model) to the load's running total,
and the listener gets that total. One call per component, not per tensor, so it costs nothing next to the
read. A component a loader reads itself, outside these functions (a GGUF transformer, the components a
single-file checkpoint lacks), is handed to ``loaded`` and counts the same way; a model built in code is not
seen here, and the worker's own count at the end of the load covers it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from diffusiond.pipelines.base import _tensor_bytes

Listener = Callable[[int], None]
"""Gets the weight bytes loaded so far, after each component."""

# module:function of diffusers that loads one component of a pipeline
_WRAPPED = ("diffusers.pipelines.pipeline_utils:load_sub_model",
            "diffusers.loaders.single_file:load_single_file_sub_model")

_local = threading.local()
_install_lock = threading.Lock()
_installed = False


class _Load:
    def __init__(self, listener: Listener) -> None:
        self.listener = listener
        self.total = 0

    def add(self, component: torch.nn.Module) -> None:
        self.total += _tensor_bytes([component])
        self.listener(self.total)


@contextlib.contextmanager
def reporting(listener: Listener) -> Iterator[None]:
    """While the body loads a model in this thread, ``listener`` gets the running total after each component."""
    _install()
    outer = getattr(_local, "load", None)
    _local.load = _Load(listener)
    try:
        yield
    finally:
        _local.load = outer


def _install() -> None:
    global _installed
    with _install_lock:
        if _installed:
            return
        for target in _WRAPPED:
            module_name, _, name = target.partition(":")
            try:
                module = importlib.import_module(module_name)
            except ImportError:  # an older or newer diffusers: that load reports only its end
                continue
            original = getattr(module, name, None)
            if callable(original):
                setattr(module, name, _counted(original))
        _installed = True


def loaded(component: Any) -> None:
    """``component`` was read by a loader itself: its bytes count toward this thread's load, if one reports."""
    load: _Load | None = getattr(_local, "load", None)
    if load is not None and isinstance(component, torch.nn.Module):
        load.add(component)


def _counted(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def load_component(*args: Any, **kwargs: Any) -> Any:
        component = original(*args, **kwargs)
        loaded(component)
        return component

    return load_component
