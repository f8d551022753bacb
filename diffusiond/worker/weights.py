"""Live LoRA updates in a worker (UPDATE_LORA): read the memfd, check against the model, apply.

The engine forwards the client's memfd as it came (no copy in between); the compute thread takes
it between batches, so a batch runs entirely before or entirely after an update. The tensors are
copied out of the mapping first and the fd closed, then checked in full against the model, and
only then is anything in the model changed: a refused update leaves the adapter as it was, and
an update is never seen half applied (there is no forward in between either way).

What is checked here, because only the model knows it: each key's component and module exist,
and its shape fits. A new adapter's ``lora_A`` must be ``(rank, in_features)`` and ``lora_B``
``(out_features, rank)`` of its Linear (a Conv2d: ``(rank, in, kh, kw)`` and ``(out, rank, 1, 1)``);
an existing adapter's tensors must be the shapes it has, and name only modules it has (an update
replaces values; a new structure is a new adapter). The first bad tensor is named.

UPDATE_WEIGHTS is the same for a whole component: each tensor names a parameter or buffer of its
``state_dict`` (LoRA layers of adapters are not part of it, and a layer they wrap keeps its base
name), must have its shape, and is copied into it in place, so a compiled model keeps its graph.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from diffusiond.ipc.messages import UpdateLora, UpdateWeights
from diffusiond.ipc.tensors import numpy_dtype
from diffusiond.pipelines.loras import Adapters
from diffusiond.pipelines.streaming import weights_changed

_KINDS = (".lora_A.weight", ".lora_B.weight")


def read_tensors(msg: UpdateLora | UpdateWeights, fd: int) -> dict[str, torch.Tensor]:
    """The update's tensors, copied out of the memfd (closed here, whatever happens). The engine
    checked that each lies inside it; the copy makes later writes by the client harmless."""
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return {}
        with mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ) as mm:
            out: dict[str, torch.Tensor] = {}
            for t in msg.tensors:
                dt = numpy_dtype(t.dtype)
                count = int(np.prod(t.shape)) if t.shape else 1
                arr = np.frombuffer(mm, dtype=dt, count=count, offset=t.offset).reshape(t.shape).copy()
                tensor = torch.from_numpy(arr)
                out[t.name] = tensor.view(torch.bfloat16) if t.dtype == "bfloat16" else tensor
                del arr
            return out
    finally:
        os.close(fd)


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
        adapters.update_live(msg.name, state, msg.version)
    except Exception as exc:  # checked above; a failure here is the model's (a hot-swap refusal, say)
        return f"{type(exc).__name__}: {exc}"
    return ""


def _check(pipe: Any, model: str, adapter: str, state: Mapping[str, torch.Tensor],
           old: Mapping[str, torch.Tensor] | None) -> str:
    ranks: dict[str, int] = {}
    for key, value in state.items():
        if old is not None:
            if key not in old:
                return (f"tensor {key!r} is not part of live LoRA {adapter!r} (an update replaces the values of "
                        "its tensors; to target other modules, create an adapter under a new name)")
            if tuple(value.shape) != tuple(old[key].shape):
                return (f"tensor {key!r} has shape {list(value.shape)}; LoRA {adapter!r} has "
                        f"{list(old[key].shape)} there")
            continue
        why = _fits(pipe, model, key, tuple(value.shape))
        if why:
            return why
        module = key[: -len(_KINDS[0])]
        rank = value.shape[0] if key.endswith(_KINDS[0]) else value.shape[1]
        if ranks.setdefault(module, rank) != rank:
            return f"tensor {key!r} has rank {rank}; its module's other matrix has rank {ranks[module]}"
    if old is None:
        for key in state:
            module, kind = key[: -len(_KINDS[0])], key[-len(_KINDS[0]):]
            other = module + (_KINDS[1] if kind == _KINDS[0] else _KINDS[0])
            if other not in state:
                return f"tensor {key!r} has no {other!r}: a new adapter needs both matrices of each module"
    return ""


def _fits(pipe: Any, model: str, key: str, shape: tuple[int, ...]) -> str:
    """Why tensor ``key`` of a new adapter does not fit the model ('' if it does)."""
    component_name, _, rest = key.partition(".")
    component = getattr(pipe, "components", {}).get(component_name)
    if not isinstance(component, torch.nn.Module):
        modules = sorted(n for n, c in getattr(pipe, "components", {}).items() if isinstance(c, torch.nn.Module))
        return (f"tensor {key!r}: model {model} has no component {component_name!r}; keys start with one of "
                f"{', '.join(modules)}")
    path = rest[: -len(_KINDS[0])]
    try:
        module = component.get_submodule(path)
    except AttributeError:
        return f"tensor {key!r}: {component_name} of model {model} has no module {path!r}"
    base = getattr(module, "base_layer", module)  # already wrapped by another adapter
    a = key.endswith(_KINDS[0])
    if isinstance(base, torch.nn.Linear):
        want = f"(rank, {base.in_features})" if a else f"({base.out_features}, rank)"
        ok = len(shape) == 2 and (shape[1] == base.in_features if a else shape[0] == base.out_features)
    elif isinstance(base, torch.nn.Conv2d):
        kh, kw = base.kernel_size
        want = f"(rank, {base.in_channels}, {kh}, {kw})" if a else f"({base.out_channels}, rank, 1, 1)"
        ok = len(shape) == 4 and (shape[1:] == (base.in_channels, *base.kernel_size) if a
                                  else shape[0] == base.out_channels and shape[2:] == (1, 1))
    else:
        return f"tensor {key!r}: module {path!r} of {component_name} is a {type(base).__name__}, which takes no LoRA"
    rank = shape[0] if a else (shape[1] if len(shape) > 1 else 0)
    if not ok or rank < 1:
        return f"tensor {key!r} has shape {list(shape)}; module {path!r} of {component_name} needs {want}"
    return ""


def apply_weights(pipeline: Any, msg: UpdateWeights, state: Mapping[str, torch.Tensor]) -> str:
    """Copy ``state`` into component ``msg.component`` in place, all checked first; '' or why not."""
    inner = getattr(pipeline, "inner", None)
    pipe = getattr(inner if inner is not None else pipeline, "pipe", None)
    components = getattr(pipe, "components", None) or {}
    component = components.get(msg.component)
    if not isinstance(component, torch.nn.Module):
        modules = sorted(n for n, c in components.items() if isinstance(c, torch.nn.Module))
        return (f"model {msg.model} has no component {msg.component!r}; its components: "
                f"{', '.join(modules) or 'none (it is not a diffusers pipeline)'}")
    own = {k.replace(".base_layer.", "."): v for k, v in component.state_dict(keep_vars=True).items()
           if ".lora_" not in k}
    for key, value in state.items():
        target = own.get(key)
        if target is None:
            return f"tensor {key!r}: {msg.component} of model {msg.model} has no parameter of that name"
        if tuple(value.shape) != tuple(target.shape):
            return f"tensor {key!r} has shape {list(value.shape)}; {msg.component} has {list(target.shape)} there"
        if not target.dtype.is_floating_point or target.dtype.itemsize < 2:
            return f"tensor {key!r}: {msg.component} keeps it as {target.dtype}, which is not updated in place"
    with torch.no_grad():
        for key, value in state.items():
            own[key].copy_(value)
    weights_changed(component)  # offload=stream: its ring's copies of the old values are dropped
    return ""
