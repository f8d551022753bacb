"""LoRA adapters of a compiled model: a fixed set of slots whose weights and scalings change in place.

Apart from ``loras.py`` because only ``--compile`` needs it, and its rules (what peft can hot-swap, what a failed
hot-swap leaves behind) are its own. ``adapters_for``, which gives a loaded model its adapters, is here because it
chooses between the two kinds, and this module builds on ``loras.py``.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from diffusiond.ipc.messages import LoraRef
from diffusiond.pipelines.errors import HalfApplied, PipelineError, fit_reason
from diffusiond.pipelines.hotswap_check import hotswap_misfit, read_adapter
from diffusiond.pipelines.loras import Adapters, Copy, copy_each, lora_refusal

log = logging.getLogger(__name__)


def adapters_for(pipeline: Any, registered: Mapping[str, str], max_loaded: int,
                 target_rank: int = 0) -> Adapters | None:
    """The adapters of a loaded ``Pipeline``, or None where its diffusers pipeline has no LoRA loader.
    A compiled one (``CompiledPipeline``) gets hot-swap slots when ``target_rank`` (the largest rank
    of the adapters registered at start) is known, else none."""
    inner = getattr(pipeline, "inner", None)
    compiled = inner is not None and bool(getattr(pipeline, "mode", ""))
    pipe = getattr(inner if compiled else pipeline, "pipe", None)
    if pipe is None or not Adapters.supported(pipe) or importlib.util.find_spec("peft") is None \
            or lora_refusal(pipeline):
        return None
    name = str(getattr(pipeline, "name", "the model"))
    if compiled:
        if target_rank < 1 or getattr(pipe, "unet", None) is None:
            return None
        hot = HotSwapAdapters(pipe, name, registered, max_loaded, target_rank)
        hot.restructured = pipeline.forget_shapes
        return hot
    return Adapters(pipe, name, registered, max_loaded)


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
    diffusers then deletes the slot from every layer. In ``update_live`` that is ``HalfApplied``: the
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

    def update_live(self, name: str, state: Mapping[str, torch.Tensor], version: int, copy: Copy = copy_each) -> None:
        """A compiled model (``copy`` unused: peft's hot-swap copies): the slot holding ``name`` takes the new
        weights by hot-swap (in place, the graph untouched); the next batch sets its scalings again. Once ``_check``
        passed, any failure of the hot-swap is ``HalfApplied``: peft may have copied part of the
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
