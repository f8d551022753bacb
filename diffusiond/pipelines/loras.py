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
recompile each time), so ``HotSwapAdapters`` keeps a fixed set of slots instead, see there.
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
from diffusiond.pipelines.errors import HalfApplied, PipelineError, fit_reason
from diffusiond.pipelines.hotswap_check import hotswap_misfit, read_adapter
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


def adapters_for(pipeline: Any, registered: Mapping[str, str], max_loaded: int,
                 target_rank: int = 0) -> Adapters | None:
    """The adapters of a loaded ``Pipeline``, or None where its diffusers pipeline has no LoRA loader.
    A compiled one (``CompiledPipeline``) gets hot-swap slots when ``target_rank`` (the largest rank
    of the adapters registered at start) is known, else none."""
    inner = getattr(pipeline, "inner", None)
    compiled = inner is not None and bool(getattr(pipeline, "mode", ""))
    pipe = getattr(inner if compiled else pipeline, "pipe", None)
    if pipe is None or not Adapters.supported(pipe) or importlib.util.find_spec("peft") is None or _refusal(pipeline):
        return None
    name = str(getattr(pipeline, "name", "the model"))
    if compiled:
        if target_rank < 1 or getattr(pipe, "unet", None) is None:
            return None
        hot = HotSwapAdapters(pipe, name, registered, max_loaded, target_rank)
        hot.restructured = pipeline.forget_shapes
        return hot
    return Adapters(pipe, name, registered, max_loaded)


def unsupported(pipeline: Any) -> str:
    """Why a pipeline takes no LoRA: for the error of each adapter registered for it."""
    if importlib.util.find_spec("peft") is None:  # diffusers' LoRA loading runs on PEFT
        return "LoRA adapters need the peft package: pip install 'diffusiond[lora]'"
    if why := _refusal(pipeline):  # before the compiled case: slots made at start would not help either
        return why
    if getattr(pipeline, "inner", None) is not None and getattr(pipeline, "mode", None):  # CompiledPipeline
        return (f"model {pipeline.name} is compiled (--compile) and its LoRA slots were not made at start: "
                "hot-swapping needs at least one adapter registered when the daemon starts (--lora NAME=PATH); "
                "its rank bounds the ranks of those added later")
    kind = type(getattr(pipeline, "pipe", pipeline)).__name__
    return f"model {getattr(pipeline, 'name', '?')} ({kind}) takes no LoRA adapters"


def _refusal(pipeline: Any) -> str:
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


def _each(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
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

    def update_live(self, name: str, state: Mapping[str, torch.Tensor], version: int, copy: Copy = _each) -> None:
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
            if why := _unsaid(exc, None if name in self.states else path, self.model_name):
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


class HotSwapAdapters(Adapters):
    """The adapters of a compiled model: ``slots`` adapter slots in the UNet, made once before the first forward and
    never changed in structure, so a switch never recompiles.

    The slots are made from the first adapter registered: it is injected once per slot, padded to ``target_rank`` and
    its scalings made tensors (peft's ``prepare_model_for_compiled_hotswap``, what diffusers' ``enable_lora_hotswap``
    runs, but over every slot). From then on an adapter enters a slot by ``load_lora_weights(..., hotswap=True)``
    (weights copied in place), and a batch sets each slot's scaling tensor in place: the adapter's own scaling times the
    request's weight, or 0 for a slot the batch does not use. "No LoRA" is every slot at 0, which adds exactly 0 to each
    base output (LoRA layers stay enabled: disabling them would be another graph).

    Limits, from diffusers/peft: the text encoder cannot be hot-swapped (it is compiled too), so an adapter with
    text-encoder weights is refused; an adapter's rank must not exceed ``target_rank`` and it may target only modules
    the first adapter targets (others: peft's "unexpected keys").

    A hot-swap that fails once ``_check`` passed cannot be undone: peft may have copied some of the slot's tensors, and
    diffusers then deletes the slot from every layer (review48-b 1). In ``update_live`` that is ``HalfApplied``: the
    adapter's weights are neither version and the worker restarts. In ``register`` and ``activate`` (no update was
    accepted) the slot is dropped instead and the worker keeps serving: the other slots and the base model are intact,
    and a restart would cost every queued job and a model load for one slot; what is left of the slot stays at scale 0,
    and its adapter counts as not loaded. The model has a slot fewer (each shape traces once more, shown as compiling:
    the structure changed); with none left, a batch with adapters is refused saying why. What peft refuses for the
    adapter itself (a module the slots lack, a shape) ``_check`` refuses first, so a misfit costs no slot.
    """

    def __init__(self, pipe: Any, model_name: str, registered: Mapping[str, str], slots: int,
                 target_rank: int) -> None:
        super().__init__(pipe, model_name, registered, slots)
        self.target_rank = target_rank
        self.slots = [f"diffusiond_slot{i}" for i in range(self.max_loaded)]
        self.in_slot: dict[str, str] = {}  # slot -> adapter name in it; a slot not here is free
        self.scalings: dict[str, list[tuple[Any, float]]] = {}  # slot -> (LoRA layer, its scaling at weight 1)
        self.lost: list[str] = []  # why each slot dropped after a failed hot-swap (see the class's docstring)
        self.restructured: Callable[[], None] = lambda: None  # adapters_for: the compiled model's forget_shapes

    def register(self, name: str, path: str) -> str:
        self.paths[name] = path
        try:
            self._check(name)
            if not self.scalings and not self.lost:
                self._make_slots(name)
            else:
                self._swap(self._free_slot(keep=set()), name)
                self._set_scales({})
                self.active = ()
        except Exception as exc:
            self.paths.pop(name, None)
            return fit_reason(exc)
        return ""

    def update_live(self, name: str, state: Mapping[str, torch.Tensor], version: int, copy: Copy = _each) -> None:
        """A compiled model (``copy`` unused: peft's hot-swap copies): the slot holding ``name`` takes the new
        weights by hot-swap (in place, the graph untouched); the next batch sets its scalings again. Once ``_check``
        passed, any failure of the hot-swap is ``HalfApplied`` (review48-b 1): peft may have copied part of the
        slot and diffusers deleted it, so the worker exits as for a failed copy, not a refusal."""
        old = self.states[name]
        self.states[name] = {**old, **state}
        try:
            self._check(name)  # a refusal: nothing in the model changed
        except BaseException:
            self.states[name] = old
            raise
        try:
            for slot in [s for s, n in self.in_slot.items() if n == name]:
                self._swap(slot, name)
        except BaseException as exc:
            self.states[name] = old
            if isinstance(exc, Exception):
                raise HalfApplied(f"the hot-swap of version {version} of LoRA {name!r} failed after it began, and "
                                  f"its slot is lost: {type(exc).__name__}: {exc}") from exc
            raise
        finally:
            self._set_scales({})  # a lost slot left ``scalings`` already: no KeyError hides the error
            self.active = ()
        self.versions[name] = version

    def activate(self, loras: Sequence[LoraRef]) -> None:
        wanted = tuple(loras)
        if wanted == self.active:
            return
        if len(wanted) > len(self.slots):
            raise PipelineError(f"{len(wanted)} LoRA adapters in one batch; this compiled model has "
                                f"{len(self.slots)} LoRA slots (--max-loras){self._lost_note()}")
        names = {r.name for r in wanted}
        weights: dict[str, float] = {}
        try:
            for ref in wanted:
                slot = next((s for s, n in self.in_slot.items() if n == ref.name), None)
                if slot is None:
                    slot = self._free_slot(keep=names)
                    self._swap(slot, ref.name)
                weights[slot] = ref.weight
                self.loaded.move_to_end(ref.name)
            self._set_scales(weights)
        except BaseException:
            self.active = ()
            self._set_scales({})  # the base model for the next batch
            raise
        self.active = wanted

    # slots ------------------------------------------------------------------------------------
    def _source(self, name: str) -> tuple[Any, dict[str, Any]]:
        path = self.paths.get(name)
        if path is None:
            raise PipelineError(f"LoRA {name!r} is not registered with this worker")
        return self._where(name, path)

    def _check(self, name: str) -> None:
        """Refuse what cannot be hot-swapped, before anything in the model changes."""
        state, alphas, metadata = read_adapter(self.pipe, *self._source(name))
        if any(not k.startswith("unet.") for k in state):
            raise PipelineError(f"model {self.model_name} is compiled (--compile) and only the UNet's LoRA layers "
                                "can be hot-swapped; this adapter also has text-encoder weights: serve the model "
                                "without --compile to use it")
        ranks = [v.shape[0] for k, v in state.items() if any(d in k for d in (".lora_A.", ".lora.down.", "lora_down"))]
        if ranks and max(ranks) > self.target_rank:
            raise PipelineError(f"its rank {max(ranks)} is above {self.target_rank}, the largest rank of the adapters "
                                f"registered when compiled model {self.model_name} started (its LoRA slots are that "
                                "size); register it at start (--lora) so the slots are made large enough")
        if self.scalings:  # peft refuses these only after copying some tensors, and diffusers deletes the slot
            why = hotswap_misfit(self.pipe.unet, self.slots[0], state, alphas, metadata)
            if why:
                raise PipelineError(f"{why}; compiled model {self.model_name}'s LoRA slots have the layers and "
                                    "sizes of the first adapter registered: register this one at start (--lora), "
                                    "or serve the model without --compile")

    def _make_slots(self, first: str) -> None:
        """Inject ``first`` into every slot, then pad and make scalings tensors. The modules are
        marked for compiling already, but nothing is traced before the warm-up, which runs later."""
        from peft.utils.hotswap import prepare_model_for_compiled_hotswap

        where, kwargs = self._source(first)
        try:
            for slot in self.slots:
                self.pipe.load_lora_weights(where, adapter_name=slot, **kwargs)
            self.pipe.set_adapters(self.slots, [1.0] * len(self.slots))
            prepare_model_for_compiled_hotswap(self.pipe.unet, target_rank=self.target_rank,
                                               check_compiled="ignore")
        except BaseException:  # e.g. it does not fit the model: no slot stays, the next adapter makes them
            made = [s for s in self.slots if s in self._adapter_names()]
            if made:
                self.pipe.delete_adapters(made)
            raise
        for slot in self.slots:
            self._record(slot, first)
        self.in_slot = {self.slots[0]: first}  # the others hold a copy, free to be overwritten
        self._set_scales({})
        log.info("made %d LoRA hot-swap slots of rank %d from %s", len(self.slots), self.target_rank, first)

    def _free_slot(self, keep: set[str]) -> str:
        """A slot for a new adapter: a free one, else the least recently used one not in ``keep``."""
        free = next((s for s in self.slots if s not in self.in_slot), None)
        if free is not None:
            return free
        for name in self.loaded:  # oldest use first
            if name not in keep:
                return next(s for s, n in self.in_slot.items() if n == name)
        raise PipelineError(f"no LoRA slot of compiled model {self.model_name} is free for this batch"
                            f"{self._lost_note()}")

    def _swap(self, slot: str, name: str) -> None:
        """Hot-swap ``name`` into ``slot``; a failure loses the slot (see the class's docstring) and is raised."""
        where, kwargs = self._source(name)
        try:
            self.pipe.load_lora_weights(where, adapter_name=slot, hotswap=True, **kwargs)
        except BaseException as exc:
            self._lose(slot, exc)
            raise
        self._record(slot, name)
        log.info("hot-swapped LoRA %s into %s", name, slot)

    def _lose(self, slot: str, exc: BaseException) -> None:
        """Drop ``slot`` from use: its adapter is no longer loaded, and what diffusers left of it (in every layer
        unless the failure escaped diffusers' cleanup) stays at scale 0, so it adds exactly nothing."""
        gone = self.in_slot.pop(slot, None)
        if gone is not None and gone not in self.in_slot.values():
            self.loaded.pop(gone, None)
        if slot in self.slots:
            self.slots.remove(slot)
        left = [(m, s) for m, s in self.scalings.pop(slot, []) if slot in m.scaling]
        for module, _ in left:
            module.scaling[slot].fill_(0.0)
        self.lost.append(f"{slot} ({type(exc).__name__}: {exc})")
        self.restructured()  # the compiled model's forget_shapes: its next batches retrace, announced
        log.error("LoRA slot %s of %s is lost after a failed hot-swap of %s (%d slot(s) left): %s: %s",
                  slot, self.model_name, gone or "an adapter", len(self.slots), type(exc).__name__, exc)

    def _lost_note(self) -> str:
        if not self.lost:
            return ""
        return (f"; {len(self.lost)} slot(s) were lost to failed hot-swaps ({'; '.join(self.lost)}): unload and "
                f"load {self.model_name} again (diffusiond unload/load) to have them again")

    def _record(self, slot: str, name: str) -> None:
        """Keep the slot's scalings at weight 1 (what the hot-swap set: alpha / rank per layer)."""
        from peft.tuners.lora import LoraLayer

        old = self.in_slot.pop(slot, None)
        if old is not None and old not in self.in_slot.values():
            self.loaded.pop(old, None)
        self.in_slot[slot] = name
        self.loaded[name] = None
        self.scalings[slot] = [(m, float(m.scaling[slot])) for m in self.pipe.unet.modules()
                               if isinstance(m, LoraLayer) and slot in m.scaling]

    def _set_scales(self, weights: Mapping[str, float]) -> None:
        """Each slot's scaling tensors in place: weight x the adapter's scaling; 0 for unused slots."""
        for slot, layers in self.scalings.items():
            w = weights.get(slot, 0.0)
            for module, scaling in layers:
                module.scaling[slot].fill_(w * scaling)


# Which tensors of a LoRA are a text encoder's (diffusers' ``text_encoder.``/``text_encoder_2.``, kohya's
# ``lora_te_``/``lora_te1_``/``lora_te2_``); every other tensor is the denoiser's, whatever its layout.
_ENCODER_PREFIXES = ("text_encoder", "lora_te")
_DENOISER_COMPONENTS = ("unet", "transformer")  # pipeline components diffusers loads a denoiser part into


def _unsaid(exc: BaseException, path: str | None, model: str) -> str:
    """What diffusers' error leaves out: the cause of "Unable to load weights" (safetensors'), or another base model."""
    root: BaseException = exc
    while (nxt := root.__cause__ or root.__context__) is not None and nxt is not root:
        root = nxt
    if path is not None and "Safetensor" in type(root).__name__:
        folder, kwargs = lora_source(path)
        return f"{Path(folder, kwargs['weight_name'])} is truncated or corrupt ({root}): download it again"
    return f"it was made for another base model than {model}: {exc}" if "size mismatch" in str(exc) else ""
