"""Live LoRA updates in a worker (UPDATE_LORA): read the memfds, check against the model, apply.

The engine forwards the client's memfds (the update's parts, ``WeightTensor.part``) as they came (no copy in
between); the compute thread takes it between batches, so a batch runs entirely before or entirely after an
update. The tensors are copied out of the memfds first and the fds closed, then checked in full against the
model, and only then is anything in the model changed: a refused update leaves the adapter as it was, and an
update is never seen half applied (there is no forward in between either way).

What is checked here, because only the model knows it: each key's component and module exist,
and its shape fits. A new adapter's ``lora_A`` must be ``(rank, in_features)`` and ``lora_B``
``(out_features, rank)`` of its Linear (a Conv2d: ``(rank, in, kh, kw)`` and ``(out, rank, 1, 1)``);
an existing adapter's tensors must be the shapes it has, and name only modules it has (an update
replaces values; a new structure is a new adapter). The first bad tensor is named.

UPDATE_WEIGHTS is the same for a whole component: each tensor names a parameter or buffer of its
``state_dict`` (LoRA layers of adapters are not part of it, and a layer they wrap keeps its base
name), must have its shape, and is copied into it in place, so a compiled model keeps its graph.
Its tensors are not copied out first: all are checked against the model from the header, then each is read
from its memfd straight into its parameter, or through pinned buffers onto the device (``update_copy``).
The refusals' words are ``pipelines/live_checks.py``'s, which the engine also uses when it checks an
update for a model with no worker against that model's files.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from diffusiond.ipc.messages import UpdateLora, UpdateWeights, WeightTensor
from diffusiond.ipc.params import ComponentTable, LayerRow, ParamRow, ParamTable
from diffusiond.pipelines.errors import HalfApplied
from diffusiond.pipelines.live_checks import (
    KINDS,
    Layer,
    adapter_misfit,
    lora_misfit,
    no_component,
    no_lora_component,
    no_module,
    out_of_reach,
    parameter_misfit,
)
from diffusiond.pipelines.loras import Adapters, unsupported
from diffusiond.pipelines.streaming import weights_changed
from diffusiond.worker import update_copy


def read_tensors(msg: UpdateLora | UpdateWeights, fds: list[int]) -> dict[str, torch.Tensor]:
    """A LoRA update's tensors, read out of its memfds into arrays of their own (all fds closed here, whatever
    happens): the adapter keeps them (``Adapters.states``). The engine checked that each lies inside its part of a
    sealed memfd. Read with ``preadv``, not through a mapping: the kernel's copy costs no page fault per 4 KiB
    (issue 29's ``update_lora`` latency; ``scripts/bench_update_io.py``). A whole component's tensors are read
    straight into its parameters instead (``apply_weights``)."""
    try:
        parts: dict[int, list[WeightTensor]] = {}
        for t in msg.tensors:
            parts.setdefault(t.part, []).append(t)
        # a thread per part, as the client wrote them (preadv lets go of the GIL, and reads take no file lock)
        with ThreadPoolExecutor(max(1, len(parts)), thread_name_prefix="diffusiond-read") as pool:
            reads = [pool.submit(_read_part, fds[part], tensors) for part, tensors in parts.items()]
            got = {name: tensor for read in reads for name, tensor in read.result().items()}
        return {t.name: got[t.name] for t in msg.tensors}  # in the order sent
    finally:
        _close(fds)


def _read_part(fd: int, tensors: list[WeightTensor]) -> dict[str, torch.Tensor]:
    return {t.name: update_copy.read_array(fd, t) for t in tensors}


def _close(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def _nothing(what: str) -> None:
    pass


def apply_update(adapters: Adapters, model: str, msg: UpdateLora, state: dict[str, torch.Tensor]) -> str:
    """Apply ``state`` to adapter ``msg.name`` (registering it if new); '' or why not."""
    old = adapters.states.get(msg.name)
    if old is None and msg.name in adapters.paths:
        return (f"LoRA {msg.name!r} was registered from a file ({adapters.paths[msg.name]}); only adapters "
                "created by update_lora can be updated: give the trainer's adapter a name of its own")
    why = _check(adapters.pipe, model, msg.name, state, old)
    if why:
        return why
    if old is None:
        return adapters.register_live(msg.name, state, msg.version)
    try:
        adapters.update_live(msg.name, state, msg.version, update_copy.copy_tensors)
    except HalfApplied:
        raise  # not a refusal: the worker exits (worker/compute.py)
    except Exception as exc:  # checked above; a failure here is the model's (a hot-swap refusal, say)
        return f"{type(exc).__name__}: {exc}"
    return ""


def _check(pipe: Any, model: str, adapter: str, state: Mapping[str, torch.Tensor],
           old: Mapping[str, torch.Tensor] | None) -> str:
    components = torch_components(pipe)  # once: diffusers' ``components`` inspects a signature at each call
    return adapter_misfit(adapter, {k: tuple(v.shape) for k, v in state.items()},
                          None if old is None else {k: tuple(v.shape) for k, v in old.items()},
                          lambda key, shape: _fits(components, model, key, shape))


def _fits(components: dict[str, torch.nn.Module], model: str, key: str, shape: tuple[int, ...]) -> str:
    """Why tensor ``key`` of a new adapter does not fit the model ('' if it does)."""
    component_name, _, rest = key.partition(".")
    component = components.get(component_name)
    if component is None:
        return no_lora_component(key, model, component_name, sorted(components))
    path = rest[: -len(KINDS[0])]
    try:
        module = component.get_submodule(path)
    except AttributeError:
        return no_module(key, model, component_name, path)
    return lora_misfit(key, shape, component_name, path, layer_of(module))


def torch_components(pipe: Any) -> dict[str, torch.nn.Module]:
    """The components an update can name: the pipeline's torch modules."""
    return {n: c for n, c in (getattr(pipe, "components", None) or {}).items() if isinstance(c, torch.nn.Module)}


def layer_of(module: torch.nn.Module) -> Layer:
    """What a LoRA matrix on ``module`` must fit."""
    base = getattr(module, "base_layer", module)  # already wrapped by another adapter
    if isinstance(base, torch.nn.Linear):
        return Layer(base.in_features, base.out_features)
    if isinstance(base, torch.nn.Conv2d):
        return Layer(base.in_channels, base.out_channels, tuple(base.kernel_size))
    return Layer(other=type(base).__name__)


def own_parameters(component: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What ``update_weights`` can name: its ``state_dict`` without adapters' layers, a wrapped layer's
    under its base name."""
    return {k.replace(".base_layer.", "."): v for k, v in component.state_dict(keep_vars=True).items()
            if ".lora_" not in k}


def kept_as(tensor: torch.Tensor) -> str:
    """What ``tensor`` is kept as when an update cannot be copied into it in place, else '': an integer or 8-bit
    storage (a quantized weight), or a tensor subclass. torchao's quantized weights (``quant=C:int8``, ``fp8=1``)
    are subclasses that report their values' dtype (bfloat16) while holding int8 or float8 data: a byte copy
    into one fails half-way, which cost the worker."""
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
        return f"a {type(tensor).__name__} (quantized, or another tensor subclass)"
    return "" if tensor.dtype.is_floating_point and tensor.dtype.itemsize >= 2 else str(tensor.dtype)


def weights_pipe(pipeline: Any) -> Any:
    """The diffusers pipeline whose components updates change (a compiled one's inner pipeline's)."""
    inner = getattr(pipeline, "inner", None)
    return getattr(inner if inner is not None else pipeline, "pipe", None)


def unreachable(own: Mapping[str, torch.Tensor]) -> bool:
    """The component's weights are not in its parameters: ``offload=sequential`` (accelerate's ``cpu_offload``)
    leaves them on the meta device and keeps the values in its hooks, and a copy into a meta tensor does
    nothing, silently."""
    return any(t.is_meta for t in own.values())


def apply_weights(pipeline: Any, msg: UpdateWeights, fds: list[int], mark: Callable[[str], None] = _nothing) -> str:
    """Copy the update's tensors (in ``fds``, its parts, which the caller closes) into component ``msg.component``
    in place, all checked first; '' or why not. The copies are done when it returns (``update_copy.copy_into``)."""
    components = torch_components(weights_pipe(pipeline))
    component = components.get(msg.component)
    if component is None:
        return no_component(msg.model, msg.component, sorted(components))
    own = own_parameters(component)
    if unreachable(own):
        return out_of_reach(msg.model, msg.component)
    for t in msg.tensors:
        target = own.get(t.name)
        have, keeps = (None, "") if target is None else (tuple(target.shape), kept_as(target))
        why = parameter_misfit(t.name, tuple(t.shape), msg.model, msg.component, have, keeps)
        if why:
            return why
    mark("checked")
    update_copy.copy_into([(own[t.name], update_copy.Source(fds[t.part], t)) for t in msg.tensors])
    mark("copied")
    weights_changed(component)  # offload=stream: its ring's copies of the old values are dropped
    return ""


def param_table(pipeline: Any, adapters: Adapters | None) -> ParamTable:
    """What the checks above read of the loaded model, for the engine to check updates the same way while
    the model runs no worker (issue 29): each component's ``own_parameters`` and every module a LoRA key
    can name, an adapter's own layers left out (they are not the model's, and a wrapped layer is named by
    its base's path). LoRA keys are checked against ``adapters.pipe``, which is ``weights_pipe``."""
    components = []
    for name, component in sorted(torch_components(weights_pipe(pipeline)).items()):
        own = own_parameters(component)
        params = [ParamRow(k, tuple(v.shape), kept_as(v)) for k, v in own.items()]
        layers = [LayerRow(path, *dataclasses.astuple(layer_of(module)))
                  for path, module in component.named_modules(remove_duplicate=False)
                  if path and not any(p == "base_layer" or p.startswith("lora_") for p in path.split("."))]
        components.append(ComponentTable(name, params, layers, out_of_reach=unreachable(own)))
    return ParamTable(components, no_lora=unsupported(pipeline) if adapters is None else "",
                      name=str(getattr(pipeline, "name", "")))
