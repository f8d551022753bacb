"""LoRA adapters in a worker: load on first use, keep a bounded set loaded, activate per batch.

Switching adapters between batches must cost no pipeline reload, so adapters stay injected in the model (PEFT layers,
one per adapter name) and a batch only changes which are active and at what weight (``set_adapters``); a batch without
adapters runs with the LoRA layers disabled, which diffusers computes exactly as the base model (no residue of an
earlier batch). At most ``max_loaded`` adapters stay in the model: the least recently used one not needed by the current
batch is deleted to make room.

An adapter can also be live (``update_lora``, worker/weights.py): its weights come from a trainer, not a file; its state
dict stays here (``states``), an eviction reloads it from memory, and an update copies the new values into its
parameters in place (a hot-swap slot keeps its structure). ``versions`` counts the updates.

``activate`` is the one place a batch's adapters take effect: the compute thread calls it right before the forward. A
compiled model cannot switch that way (injecting, deleting or activating an adapter changes the traced graph: a
recompile each time), so ``hotswap.HotSwapAdapters`` keeps a fixed set of slots instead, see there;
``hotswap.adapters_for`` gives a loaded model the one of the two that fits it.
"""

from __future__ import annotations

import collections
import importlib.util
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from diffusiond.ipc.messages import LIVE_PATH, LoraRef
from diffusiond.pipelines.errors import PipelineError, fit_reason, root_cause
from diffusiond.pipelines.lora_dtypes import adapters_in_compute_dtype, lift_from_storage_dtype
from diffusiond.pipelines.spec import FP8_ROWS_NAME

log = logging.getLogger(__name__)


def lora_source(path: str) -> tuple[str, dict[str, Any]]:
    """``load_lora_weights``' arguments for a folder (diffusers' ``save_lora_weights`` layout) or a
    single ``.safetensors`` file (diffusers or kohya layout, converted by diffusers on load)."""
    p = Path(path)
    if p.is_dir():
        return str(p), {"weight_name": "pytorch_lora_weights.safetensors"}
    return str(p.parent), {"weight_name": p.name}


def unsupported(pipeline: Any) -> str:
    """Why a pipeline takes no LoRA: for the error of each adapter registered for it."""
    if importlib.util.find_spec("peft") is None:  # diffusers' LoRA loading runs on PEFT
        return "LoRA adapters need the peft package: pip install 'diffusiond[lora]'"
    if why := lora_refusal(pipeline):  # before the compiled case: slots made at start would not help either
        return why
    if getattr(pipeline, "inner", None) is not None and getattr(pipeline, "mode", None):  # CompiledPipeline
        return (f"model {pipeline.name} is compiled (--compile) and its LoRA slots were not made at start: "
                "hot-swapping needs at least one adapter registered when the daemon starts (--lora NAME=PATH); "
                "its rank bounds the ranks of those added later")
    kind = type(getattr(pipeline, "pipe", pipeline)).__name__
    return f"model {getattr(pipeline, 'name', '?')} ({kind}) takes no LoRA adapters"


def lora_refusal(pipeline: Any) -> str:
    """Why a model that could take adapters refuses them: an offload moving each layer's weights, or fp8=rowwise."""
    name, mode = getattr(pipeline, "name", "?"), str(getattr(getattr(pipeline, "inner", pipeline), "offload", "none"))
    if mode in ("group", "sequential", "stream"):
        return (f"model {name} runs with offload={mode}, whose hooks move each layer's weights in and out; diffusiond "
                "does not add LoRA layers under them: serve it with offload=model or none to use adapters")
    if FP8_ROWS_NAME in getattr(getattr(pipeline, "capabilities", None), "approximations", ()):
        return (f"model {name} runs with fp8=rowwise, whose fp8 linear layers take no LoRA layers (peft wraps "
                "torch's own): serve it without fp8=rowwise to use adapters")
    return ""


Copy = Callable[[list[tuple[torch.Tensor, torch.Tensor]]], None]  # values into parameters, done when it returns


def copy_each(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """The copy a caller without staging buffers gets: one tensor after another, on the current stream."""
    with torch.no_grad():
        for dst, src in pairs:
            dst.copy_(src)


class Adapters:
    """The adapters of one diffusers pipeline: registered (name -> path) and loaded (an LRU)."""

    def __init__(self, pipe: Any, model_name: str, registered: Mapping[str, str], max_loaded: int) -> None:
        self.pipe = pipe
        self.model_name = model_name
        self.paths: dict[str, str] = dict(registered)
        self.max_loaded = max(1, max_loaded)
        self.loaded: collections.OrderedDict[str, None] = collections.OrderedDict()  # oldest use first
        self.active: tuple[LoraRef, ...] = ()
        self.states: dict[str, dict[str, torch.Tensor]] = {}  # live adapters' latest weights
        self.versions: dict[str, int] = {}  # live adapters' version (file-registered ones: 0)

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
            return fit_reason(exc)
        return ""

    def register_live(self, name: str, state: dict[str, torch.Tensor], version: int) -> str:
        """Add live adapter ``name`` from its state dict; '' if it loads, else the reason."""
        self.states[name] = state
        why = self.register(name, LIVE_PATH)
        if why:
            self.states.pop(name, None)
        else:
            self.versions[name] = version
        return why

    def update_live(self, name: str, state: Mapping[str, torch.Tensor], version: int, copy: Copy = copy_each) -> None:
        """New values for some of live adapter ``name``'s tensors (checked to match it already):
        copied into its parameters in place where it is loaded (by ``copy``: the worker stages them through
        pinned buffers), kept for a reload where not."""
        if name in self.loaded:  # copied first: a copy that fails leaves the kept values the version in force
            components = self.pipe.components  # once: diffusers' property inspects the pipeline's signature, and
            # per tensor that was 42 of 62 ms for FLUX's 532 (issue 29's update_lora latency)
            copy([(self._parameter(components, key, name), value) for key, value in state.items()])
        self.states[name] = {**self.states[name], **state}
        self.versions[name] = version

    @staticmethod
    def _parameter(components: Mapping[str, Any], key: str, adapter: str) -> torch.Tensor:
        """The parameter a diffusers/PEFT key (``unet.<module>.lora_A.weight``) names in ``adapter``."""
        component, _, rest = key.partition(".")
        module, _, kind = rest.rpartition(".lora_")
        layer = getattr(components[component].get_submodule(module), "lora_" + kind.split(".")[0])
        weight: torch.Tensor = layer[adapter].weight
        return weight

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
        while len(self.loaded) >= self.max_loaded and (victim := next((n for n in self.loaded if n not in keep), None)):
            self._unload(victim)

    def _load(self, name: str) -> None:
        path = self.paths.get(name)
        if path is None:
            raise PipelineError(f"LoRA {name!r} is not registered with this worker")
        self._make_room(keep={name})
        where, kwargs = self._where(name, path)
        before = self._adapter_names()
        try:
            with adapters_in_compute_dtype():  # an fp8-stored layer's adapter keeps the file's values exactly
                self.pipe.load_lora_weights(where, adapter_name=name, **kwargs)
            if name not in self._adapter_names() - before:
                raise PipelineError(f"no module of {self.model_name} matched the LoRA's weights")
            self._refuse_a_lost_denoiser_part(name, path)
        except Exception as exc:
            if name in self._adapter_names():
                self.pipe.delete_adapters([name])
            if why := _explain_load_failure(exc, None if name in self.states else path, self.model_name):
                raise PipelineError(why) from exc
            raise
        lift_from_storage_dtype(self.pipe, name)
        self.loaded[name] = None
        self.active = ()  # loading may change which adapters the model has active
        self.pipe.disable_lora()
        log.info("loaded LoRA %s from %s (%d loaded)", name, path, len(self.loaded))

    def _refuse_a_lost_denoiser_part(self, name: str, path: str) -> None:
        """A LoRA fits only if its denoiser part, when it has one, went into this model's denoiser.

        diffusers loads what matches a pipeline's components and drops the rest with a log line: an
        SD 1.5 LoRA on FLUX loses its UNet part and keeps its CLIP text-encoder part (FLUX has a
        CLIP encoder too), which would serve a silently different adapter from the one trained. A
        text-encoder-only LoRA is a LoRA for the encoder and fits where that part loads."""
        keys = self._keys(name, path)
        part = [k for k in keys if not k.startswith(_ENCODER_PREFIXES)]
        denoisers = {c: type(m).__name__ for c, m in self.pipe.components.items()
                     if c.startswith(_DENOISER_COMPONENTS) and m is not None}
        landed = {c for c, names in self.pipe.get_list_adapters().items() if name in names}
        if not part or landed & set(denoisers):
            return
        head = part[0].split(".", 1)[0]
        label = head if len(head) <= 24 else head[:24] + "..."
        kind = " and ".join(sorted(set(denoisers.values()))) or "none that diffusers loads LoRAs into"
        loaded = f"only its {', '.join(sorted(landed))} part would load, " if landed else ""
        raise PipelineError(
            f"its denoiser part ({len(part)} tensors named {label!r}) does not apply to {self.model_name}, whose "
            f"denoiser is {kind}: the LoRA was made for another model family; {loaded}a different adapter from "
            "the one trained. Serve it with a model of its own family")

    def _keys(self, name: str, path: str) -> list[str]:
        """The tensor names of the LoRA as given (a live adapter's state, else its file's header)."""
        live = self.states.get(name)
        if live is not None:
            return list(live)
        from safetensors import safe_open

        folder, kwargs = lora_source(path)
        with safe_open(str(Path(folder) / kwargs["weight_name"]), framework="pt") as f:
            return list(f.keys())

    def _where(self, name: str, path: str) -> tuple[Any, dict[str, Any]]:
        """``load_lora_weights``' arguments: a copy of a live adapter's state dict (diffusers pops
        from what it is given), else the file's."""
        live = self.states.get(name)
        return (dict(live), {}) if live is not None else lora_source(path)

    def _unload(self, name: str) -> None:
        self.pipe.delete_adapters([name])
        self.loaded.pop(name, None)
        self.pipe.disable_lora()  # the adapters left may be active now: back to a known state
        self.active = ()
        log.info("unloaded LoRA %s (least recently used)", name)

    def _adapter_names(self) -> set[str]:
        return {a for names in self.pipe.get_list_adapters().values() for a in names}


# Which tensors of a LoRA are a text encoder's (diffusers' ``text_encoder.``/``text_encoder_2.``, kohya's
# ``lora_te_``/``lora_te1_``/``lora_te2_``); every other tensor is the denoiser's, whatever its layout.
_ENCODER_PREFIXES = ("text_encoder", "lora_te")
_DENOISER_COMPONENTS = ("unet", "transformer")  # pipeline components diffusers loads a denoiser part into


def _explain_load_failure(exc: BaseException, path: str | None, model: str) -> str:
    """What diffusers' error leaves out ('' where nothing): that the file is damaged (the cause safetensors gave,
    under diffusers' "Unable to load weights"), or that its tensors are another base model's sizes."""
    root = root_cause(exc)
    if path is not None and "Safetensor" in type(root).__name__:
        folder, kwargs = lora_source(path)
        return f"{Path(folder, kwargs['weight_name'])} is truncated or corrupt ({root}): download it again"
    if "size mismatch" not in str(exc):
        return ""
    # the advice before torch's message, whose lines after the first ``fit_reason`` only counts
    return f"it was made for another base model than {model}; serve it with a model of its own family: {exc}"
