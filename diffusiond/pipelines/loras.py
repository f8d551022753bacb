"""LoRA adapters in a worker: load on first use, keep a bounded set loaded, activate per batch.

Switching adapters between batches must cost no pipeline reload, so adapters stay injected in
the model (PEFT layers, one per adapter name) and a batch only changes which are active and at
what weight (``set_adapters``); a batch without adapters runs with the LoRA layers disabled, which
diffusers computes exactly as the base model (no residue of an earlier batch). At most
``max_loaded`` adapters stay in the model: the least recently used one not needed by the current
batch is deleted to make room.

``activate`` is the one place a batch's adapters take effect: the compute thread calls it right
before the forward. A compiled model (the speed work) will instead load every adapter into one
set of slots with ``enable_lora_hotswap(target_rank=...)`` before compiling and
``load_lora_weights(..., hotswap=True)`` here, so that switching never recompiles; only
``_load`` and ``activate`` change for that.
"""

from __future__ import annotations

import collections
import importlib.util
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from diffusiond.ipc.messages import LoraRef
from diffusiond.pipelines.errors import PipelineError

log = logging.getLogger(__name__)


def lora_source(path: str) -> tuple[str, dict[str, Any]]:
    """``load_lora_weights``' arguments for a folder (diffusers' ``save_lora_weights`` layout) or a
    single ``.safetensors`` file (diffusers or kohya layout, converted by diffusers on load)."""
    p = Path(path)
    if p.is_dir():
        return str(p), {"weight_name": "pytorch_lora_weights.safetensors"}
    return str(p.parent), {"weight_name": p.name}


def adapters_for(pipeline: Any, registered: Mapping[str, str], max_loaded: int) -> Adapters | None:
    """The adapters of a loaded ``Pipeline``, or None where its diffusers pipeline has no LoRA loader."""
    pipe = getattr(pipeline, "pipe", None)
    if pipe is None or not Adapters.supported(pipe) or importlib.util.find_spec("peft") is None:
        return None
    return Adapters(pipe, str(getattr(pipeline, "name", "the model")), registered, max_loaded)


def unsupported(pipeline: Any) -> str:
    """Why a pipeline takes no LoRA: for the error of each adapter registered for it."""
    if importlib.util.find_spec("peft") is None:  # diffusers' LoRA loading runs on PEFT
        return "LoRA adapters need the peft package: pip install 'diffusiond[lora]'"
    if getattr(pipeline, "inner", None) is not None and getattr(pipeline, "mode", None):  # CompiledPipeline
        return (f"model {pipeline.name} is compiled (--compile): LoRA adapters there need hot-swapping "
                "(enable_lora_hotswap before compiling), which is not wired yet; serve it without --compile")
    pipe = getattr(pipeline, "pipe", pipeline)
    return f"model {getattr(pipeline, 'name', '?')} ({type(pipe).__name__}) takes no LoRA adapters"


class Adapters:
    """The adapters of one diffusers pipeline: registered (name -> path) and loaded (an LRU)."""

    def __init__(self, pipe: Any, model_name: str, registered: Mapping[str, str], max_loaded: int) -> None:
        self.pipe = pipe
        self.model_name = model_name
        self.paths: dict[str, str] = dict(registered)
        self.max_loaded = max(1, max_loaded)
        self.loaded: collections.OrderedDict[str, None] = collections.OrderedDict()  # oldest use first
        self.active: tuple[LoraRef, ...] = ()

    @staticmethod
    def supported(pipe: Any) -> bool:
        return all(hasattr(pipe, m) for m in ("load_lora_weights", "set_adapters", "disable_lora", "delete_adapters"))

    # registration ---------------------------------------------------------------------------
    def register(self, name: str, path: str) -> str:
        """Add (or replace) adapter ``name``; '' if it loads into the model, else the reason."""
        if name in self.loaded:
            self._unload(name)
        self.paths[name] = path
        try:
            self._load(name)
        except Exception as exc:
            self.paths.pop(name, None)
            self.loaded.pop(name, None)
            return f"{type(exc).__name__}: {exc}"
        return ""

    # per batch ------------------------------------------------------------------------------
    def activate(self, loras: Sequence[LoraRef]) -> None:
        """Make exactly ``loras`` (at their weights) act on the next forward; none: the base model."""
        wanted = tuple(loras)
        if wanted == self.active:
            return
        if not wanted:
            self.pipe.disable_lora()
            self.active = ()
            return
        if len(wanted) > self.max_loaded:
            raise PipelineError(f"{len(wanted)} LoRA adapters in one batch; this worker keeps at most "
                                f"{self.max_loaded} loaded (--max-loras)")
        names = [r.name for r in wanted]
        try:
            for name in names:
                if name in self.loaded:
                    self.loaded.move_to_end(name)
                else:
                    self._make_room(keep=set(names))
                    self._load(name)
            self.pipe.enable_lora()
            self.pipe.set_adapters(names, [r.weight for r in wanted])
        except BaseException:
            self.active = ()  # half switched: fail this batch, and leave the base model for the next
            self.pipe.disable_lora()
            raise
        self.active = wanted

    # loading --------------------------------------------------------------------------------
    def _make_room(self, keep: set[str]) -> None:
        while len(self.loaded) >= self.max_loaded:
            victim = next((n for n in self.loaded if n not in keep), None)
            if victim is None:
                return
            self._unload(victim)

    def _load(self, name: str) -> None:
        path = self.paths.get(name)
        if path is None:
            raise PipelineError(f"LoRA {name!r} is not registered with this worker")
        self._make_room(keep={name})
        where, kwargs = lora_source(path)
        before = self._adapter_names()
        try:
            self.pipe.load_lora_weights(where, adapter_name=name, **kwargs)
        except Exception:
            if name in self._adapter_names():
                self.pipe.delete_adapters([name])
            raise
        if name not in self._adapter_names() - before:
            raise PipelineError(f"no module of {self.model_name} matched the LoRA's weights")
        self.loaded[name] = None
        self.active = ()  # loading may change which adapters the model has active
        self.pipe.disable_lora()
        log.info("loaded LoRA %s from %s (%d loaded)", name, path, len(self.loaded))

    def _unload(self, name: str) -> None:
        self.pipe.delete_adapters([name])
        self.loaded.pop(name, None)
        self.pipe.disable_lora()  # the adapters left may be active now: back to a known state
        self.active = ()
        log.info("unloaded LoRA %s (least recently used)", name)

    def _adapter_names(self) -> set[str]:
        return {a for names in self.pipe.get_list_adapters().values() for a in names}
