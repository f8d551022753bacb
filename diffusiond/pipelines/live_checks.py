"""Why a live update does not fit a model, in one wording for both places that can tell (issue 29).

A worker checks an update against the model it loaded (``worker/weights.py``); the engine checks one meant for
a model that runs no worker against what that model held when it last loaded, else its files' headers
(``daemon/core/file_checks.py``), so that a bad update is refused at once instead of being kept and found bad
when the model starts. The trainer must read the same refusal whichever of the two answered, so both describe
what they see (a parameter's shape, a layer's kind and sizes) and take the words from here. Torch-free: the
engine uses it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

KINDS = (".lora_A.weight", ".lora_B.weight")
Shape = tuple[int, ...]


@dataclass(frozen=True)
class Layer:
    """What a LoRA matrix must fit: a Linear (``kernel`` empty) or a Conv2d, by its sizes; ``other`` names
    the class of a module that takes no LoRA."""

    in_features: int = 0
    out_features: int = 0
    kernel: Shape = ()
    other: str = ""


def no_lora_component(key: str, model: str, component: str, modules: Iterable[str]) -> str:
    return f"tensor {key!r}: model {model} has no component {component!r}; keys start with one of {', '.join(modules)}"


def no_module(key: str, model: str, component: str, path: str) -> str:
    return f"tensor {key!r}: {component} of model {model} has no module {path!r}"


def lora_misfit(key: str, shape: Shape, component: str, path: str, layer: Layer) -> str:
    """Why LoRA matrix ``key`` of a new adapter does not fit ``layer`` ('' if it does)."""
    if layer.other:
        return f"tensor {key!r}: module {path!r} of {component} is a {layer.other}, which takes no LoRA"
    a = key.endswith(KINDS[0])
    if not layer.kernel:
        want = f"(rank, {layer.in_features})" if a else f"({layer.out_features}, rank)"
        ok = len(shape) == 2 and (shape[1] == layer.in_features if a else shape[0] == layer.out_features)
    else:
        kh, kw = layer.kernel
        want = f"(rank, {layer.in_features}, {kh}, {kw})" if a else f"({layer.out_features}, rank, 1, 1)"
        ok = len(shape) == 4 and (shape[1:] == (layer.in_features, kh, kw) if a
                                  else shape[0] == layer.out_features and shape[2:] == (1, 1))
    rank = shape[0] if a else (shape[1] if len(shape) > 1 else 0)
    if not ok or rank < 1:
        return f"tensor {key!r} has shape {list(shape)}; module {path!r} of {component} needs {want}"
    return ""


def adapter_misfit(adapter: str, shapes: Mapping[str, Shape], old: Mapping[str, Shape] | None,
                   fits: Callable[[str, Shape], str]) -> str:
    """Why an update of LoRA ``adapter`` is refused ('' if it is not): for an existing adapter (``old``:
    its tensors' shapes), a tensor it lacks or another shape, which needs no model; for a new one, what
    ``fits`` says of each matrix against the model, one rank per module, and both matrices of each."""
    ranks: dict[str, int] = {}
    for key, shape in shapes.items():
        if old is not None:
            if key not in old:
                return (f"tensor {key!r} is not part of live LoRA {adapter!r} (an update replaces the values of "
                        "its tensors; to target other modules, create an adapter under a new name)")
            if tuple(shape) != tuple(old[key]):
                return f"tensor {key!r} has shape {list(shape)}; LoRA {adapter!r} has {list(old[key])} there"
            continue
        why = fits(key, shape)
        if why:
            return why
        module = key[: -len(KINDS[0])]
        rank = shape[0] if key.endswith(KINDS[0]) else shape[1]
        if ranks.setdefault(module, rank) != rank:
            return f"tensor {key!r} has rank {rank}; its module's other matrix has rank {ranks[module]}"
    if old is None:
        for key in shapes:
            module, kind = key[: -len(KINDS[0])], key[-len(KINDS[0]):]
            other = module + (KINDS[1] if kind == KINDS[0] else KINDS[0])
            if other not in shapes:
                return f"tensor {key!r} has no {other!r}: a new adapter needs both matrices of each module"
    return ""


def no_component(model: str, component: str, modules: Iterable[str]) -> str:
    return (f"model {model} has no component {component!r}; its components: "
            f"{', '.join(modules) or 'none (it is not a diffusers pipeline)'}")


def out_of_reach(model: str, component: str) -> str:
    """``update_weights`` of a component under ``offload=sequential``: accelerate's hooks hold its weights and copy
    them into each layer for its forward only, leaving its parameters on the meta device. A copy into those writes
    nowhere and raises nothing, so such an update was taken, versioned and changed nothing."""
    return (f"{component} of model {model} runs with offload=sequential, which keeps its weights in accelerate's "
            "offload hooks (its parameters are on the meta device), where an update cannot reach them: serve "
            f"{model} with offload=model, group or none to update {component} live")


def parameter_misfit(key: str, shape: Shape, model: str, component: str, have: Shape | None, keeps: str) -> str:
    """Why whole-parameter update ``key`` does not fit (``have``: the parameter's shape, None if there is
    none of that name; ``keeps``: the dtype it is kept in when that is not updated in place, else '')."""
    if have is None:
        return f"tensor {key!r}: {component} of model {model} has no parameter of that name"
    if tuple(shape) != tuple(have):
        return f"tensor {key!r} has shape {list(shape)}; {component} has {list(have)} there"
    if keeps:
        return (f"tensor {key!r}: {component} keeps it as {keeps}, which is not updated in place: serve the model "
                "without its quantization (quant=, fp8=) to update this tensor")
    return ""
