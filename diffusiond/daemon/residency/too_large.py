"""The words of a ``model_too_large`` refusal: what the model (and a job's size) needs on the device, what the
budget leaves it, and what would make it fit; and those of a run that failed out of memory after its retries. Split
off ``policy.py``, which decides when each applies."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from diffusiond.daemon.residency.decisions import OomFail, TooLarge
from diffusiond.daemon.residency.entry import ModelEntry
from diffusiond.daemon.residency.units import format_bytes
from diffusiond.daemon.residency.working import Estimate, Shape
from diffusiond.pipelines.errors import PipelineError
from diffusiond.pipelines.spec import offload_mode, parse_spec


def too_large(m: ModelEntry, device: str, budget: int, shape: Shape | None, known: int, est: Estimate,
              pinned: list[ModelEntry]) -> TooLarge:
    """``m`` with ``known`` bytes of measured working memory for ``shape`` cannot fit ``budget`` on ``device`` even
    with every other model evicted: ``pinned`` ones, which never are, hold part of it."""
    copies = m.devices.count(device)
    need = m.size(device) + known
    pinned_bytes = sum(p.size(device) for p in pinned)
    each = f", {copies} workers there, each with its copy" if copies > 1 else ""
    working = f" + {format_bytes(known)} of working memory for {shape} ({est.floor_how})" if known else ""
    beside = (f", and {', '.join(sorted(p.name for p in pinned))} (pinned) hold {format_bytes(pinned_bytes)} "
              "of it" if pinned else "")
    hints = [f"a larger --device-memory for {device} (at least {format_bytes(need + pinned_bytes)})"]
    if pinned:
        hints.append(f"unpinning {', '.join(sorted(p.name for p in pinned))}")
    if known:
        hints.append("a smaller size or batch")
    hints.extend(m.hints or ("CPU offloading or a quantized variant, where the model supports them",))
    if copies > 1:
        hints.append(f"fewer workers on {device} (--workers)")
    message = (f"model {m.name!r} cannot fit on {device}: it needs {format_bytes(need)} "
               f"({format_bytes(m.size(device))} of weights{each}{working}) and the budget there is "
               f"{format_bytes(budget)}{beside}. What would make it fit: {'; '.join(hints)}")
    return TooLarge(m.name, need, budget, tuple(hints), message, device=device)


def out_of_memory(m: ModelEntry, shape: Shape, attempt: int, est: Estimate, budget: int) -> OomFail:
    """A run of ``shape`` out of memory on ``m``'s device at ``attempt`` (``Residency.on_oom``), past its retries."""
    split = ", and as halves of a larger batch" if attempt >= 2 else ""
    return OomFail(m.name, f"out of memory running {m.name} on {m.device} at {shape}, after evicting idle models "
                           f"and retrying{split}: the budget is {format_bytes(budget)} "
                           f"({format_bytes(m.weight_bytes)} of it the weights; working memory {est.how}: "
                           f"{format_bytes(est.nbytes)}). Try a smaller size or batch, a larger --device-memory, "
                           f"fewer programs on the GPU{''.join(f', or {h}' for h in m.hints)}")


def too_large_hints(spec: str, on_cpu: bool, options: Mapping[str, str] | None = None,
                    auto: bool = False) -> tuple[str, ...]:
    """What would make a model fit, for its ``model_too_large`` refusal and its out-of-memory failure, for the
    offload it runs with (``options``, made concrete at start; ``auto``: chosen by offload=auto, which is then no
    hint). A stream plan gives room by keeping fewer blocks."""
    see = f"`diffusiond fit {spec}{' --device cpu' if on_cpu else ''} --device-memory SIZE` lists what fits"
    if on_cpu:
        return (f"a smaller --dtype or quant= (on a CPU nothing can be offloaded); {see}",)
    try:
        mode = offload_mode({**parse_spec(spec).options, **(options or {})})
    except PipelineError:
        mode = "none"
    if mode == "stream":
        return (f"fewer resident blocks (offload=stream,resident_blocks=K: `diffusiond fit {spec} --device-memory "
                "SIZE --size WxH --batch N` prints K, with SIZE the budget less the ControlNets, IP-Adapters and "
                "upscalers kept beside it), or offload=group, which leaves the budget to activations",)
    if mode in ("none", "auto") and not auto:
        return (f"offload=auto (the fastest offload that fits, chosen at start); {see}",)
    if mode in ("none", "fp8"):
        return (f"offload=group, which keeps a few blocks on the device and leaves the budget to activations; {see}",)
    if mode == "sequential":
        return (f"quant= or a smaller --dtype (offload=sequential keeps the least already); {see}",)
    return (f"an offload that keeps less on the device (offload=sequential), or quant=; {see}",)


def past_budget(name: str, devices: Sequence[str], held: int, estimate: int, budgets: Mapping[str, int]) -> list[str]:
    """The log's words where a worker's count of a model leaves it no room in a budget that its files' headers
    fitted (what it keeps beside, such as ControlNets, is counted only once it has loaded): from then on its jobs
    are refused, and nothing at the start said so."""
    return [f"model {name} holds {format_bytes(held)} on {device} once loaded (its files' headers counted "
            f"{format_bytes(estimate)}), more than the budget of {format_bytes(budgets[device])} there: its jobs are "
            "refused with model_too_large; give a larger --device-memory, or an offload that keeps less on the device"
            for device in dict.fromkeys(devices) if device in budgets and held > budgets[device] >= estimate]
