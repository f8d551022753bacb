"""``offload=model|group|sequential|stream``: running a model bigger than its device, and what it then keeps there.

- ``model``: diffusers' ``enable_model_cpu_offload``: one whole component on the device at a time.
- ``group``: diffusers' group offloading. The denoiser is split ``block_level``, one block per group (the
  direct children that are ModuleLists of blocks; the rest of it is one group), the other components
  ``leaf_level`` (their blocks sit deeper, T5's under ``encoder.block``, so block level would move a whole
  9 GB encoder as one group). On CUDA ``use_stream=True`` copies the next group from pinned host memory on
  a side stream while the current one computes, which is what keeps the GPU busy.
- ``sequential``: ``enable_sequential_cpu_offload``: each layer's weights are moved in for its forward.
- ``stream``: ``resident_blocks`` of the denoiser's blocks stay on the device and the rest stream through a
  ring of device slots (``streaming.py``; the daemon picks the number from its budget, ``stream_plan.py``);
  the other components as under ``group``, leaf level, which moves a few of their layers at a time.

``device_bytes`` is what residency counts such a model at (``base.weight_bytes``): the same rule as
``daemon/residency/fit.py`` applies to the files' headers, here applied to the loaded modules, so a model
placed by ``fit``'s figures is counted by the same figures once it runs: the largest component for
``model``, the largest leaf for ``sequential``, and for ``group`` the largest component's always-resident
group plus twice its largest group (the one computing and the one being prefetched); for ``stream`` the
denoiser's parts outside its blocks, its resident blocks and the ring, plus what the largest other component
keeps there under leaf-level group offloading (``stream_plan.StreamPlan.device_bytes``).

``host_bytes`` is what such a model keeps in host memory meanwhile, counted against ``--host-memory``
(``daemon/residency/host_memory.py``), again ``fit``'s rule: all of it for ``model``, ``group`` and
``sequential`` (between forwards every weight waits there, in pinned copies for ``group`` on CUDA), all but
the denoiser's resident part for ``stream``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import diffusiond.pipelines.stream_plan as stream_plan
import diffusiond.pipelines.streaming as streaming
from diffusiond.pipelines.errors import PipelineError

MODES = ("model", "group", "sequential", "stream")
DENOISERS = ("transformer", "unet")


def apply_offload(pipe: Any, mode: str, device: torch.device,
                  resident_blocks: int | None = None) -> streaming.BlockStreamer | None:
    """Set ``pipe`` up to run on ``device`` with ``mode``; the errors name the option and what to do. For
    ``stream``, the denoiser's streamer (the pipeline moves its resident part when it sleeps)."""
    if device.type == "cpu":
        raise PipelineError(f"offload={mode} needs an accelerator device: on cpu the weights are in host memory "
                            "already, so there is nothing to offload to; use offload=none (or leave it out)")
    try:
        if mode == "model":
            pipe.enable_model_cpu_offload(device=device)
        elif mode == "sequential":
            pipe.enable_sequential_cpu_offload(device=device)
        elif mode == "group":
            stream = device.type == "cuda"
            for name, module in _modules(pipe).items():
                _group(module, name in DENOISERS, device, stream)
        elif mode == "stream":
            return _stream(pipe, device, resident_blocks)
        else:
            raise PipelineError(f"offload={mode!r} is not one of none, {', '.join(MODES)}")
    except ImportError as exc:
        raise PipelineError(f"offload={mode} needs the accelerate package (pip install accelerate): {exc}") from exc
    return None


def _stream(pipe: Any, device: torch.device, resident_blocks: int | None) -> streaming.BlockStreamer:
    if resident_blocks is None:
        raise PipelineError("offload=stream needs resident_blocks=N, the denoiser blocks kept on the device: the "
                            "daemon chooses it from --device-memory; loaded by hand, give it (diffusiond fit "
                            "SPEC --device-memory SIZE prints it)")
    name, denoiser = _denoiser(pipe)
    streamer = streaming.BlockStreamer(denoiser, device, resident_blocks)
    for other, module in _modules(pipe).items():
        if other != name:
            _group(module, False, device, device.type == "cuda")
    return streamer


def _denoiser(pipe: Any) -> tuple[str, torch.nn.Module]:
    modules = _modules(pipe)
    name = next((n for n in DENOISERS if n in modules), None)
    if name is None:
        raise PipelineError(f"offload=stream streams a denoiser's blocks, and {type(pipe).__name__} has no "
                            f"{' or '.join(DENOISERS)} component; use offload=group or model")
    return name, modules[name]


def _group(module: torch.nn.Module, denoiser: bool, device: torch.device, stream: bool) -> None:
    from diffusers.hooks import apply_group_offloading

    apply_group_offloading(module, onload_device=device, offload_device=torch.device("cpu"),
                           offload_type="block_level" if denoiser else "leaf_level",
                           num_blocks_per_group=1 if denoiser else None, use_stream=stream)


def _modules(pipe: Any) -> dict[str, torch.nn.Module]:
    return {n: c for n, c in pipe.components.items() if isinstance(c, torch.nn.Module)}


def _bytes(tensors: Any, seen: set[int]) -> int:
    """Each tensor once by its storage's address; tensors with none (meta, as accelerate's sequential offload
    leaves the modules' own, the weights kept in its map) each count, or all of them would count as one."""
    total = 0
    for t in tensors:
        ptr = t.data_ptr()
        if ptr and ptr in seen:
            continue
        seen.add(ptr)
        total += t.numel() * t.element_size()
    return total


def _own(module: torch.nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(recurse=False), *module.buffers(recurse=False)]


def _all(module: torch.nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(), *module.buffers()]


def _largest_leaf(module: torch.nn.Module) -> int:
    return max((_bytes(_own(m), set()) for m in module.modules()), default=0)


def _group_bytes(name: str, module: torch.nn.Module) -> int:
    if name not in DENOISERS:
        return 2 * _largest_leaf(module)
    always = _bytes(_own(module), set())
    largest = 0
    for child in module.children():
        if isinstance(child, torch.nn.ModuleList | torch.nn.Sequential):
            largest = max([largest, *(_bytes(_all(block), set()) for block in child)])
        else:
            always += _bytes(_all(child), set())
    return always + 2 * largest


def stream_sizes(pipe: Any) -> tuple[dict[str, list[int]], int, int]:
    """The denoiser's blocks' tensor sizes, its bytes outside them, and what the other components keep on
    the device while they run: ``stream_plan``'s inputs, from the loaded modules."""
    name, denoiser = _denoiser(pipe)
    blocks = {n: streaming.tensor_bytes(b) for n, b in streaming.blocks_of(denoiser).items()}
    others = max((_group_bytes(n, m) for n, m in _modules(pipe).items() if n != name), default=0)
    return blocks, streaming.always_bytes(denoiser), others


def plan_stream(pipe: Any, fits: Callable[[int], bool]) -> tuple[stream_plan.StreamPlan, bool]:
    """The most resident blocks whose device bytes ``fits`` (the budget less the working memory): what the
    daemon computes from the files' headers, computed here from a pipeline built in code (benchmarks)."""
    blocks, always, others = stream_sizes(pipe)
    return stream_plan.choose(blocks, always, others, fits)


def device_bytes(pipe: Any, mode: str) -> int:
    """What ``mode`` keeps of ``pipe`` on the device at most (the module docstring's rule)."""
    modules = _modules(pipe)
    if mode == "stream":
        return _applied_plan(pipe).device_bytes
    if mode == "model":
        return max((_bytes(_all(m), set()) for m in modules.values()), default=0)
    if mode == "sequential":
        return max((_largest_leaf(m) for m in modules.values()), default=0)
    return max((_group_bytes(n, m) for n, m in modules.items()), default=0)


def host_bytes(pipe: Any, mode: str) -> int:
    """What ``mode`` keeps of ``pipe`` in host memory while the model is on its device (the module docstring's
    rule); 0 for ``none``."""
    if mode not in MODES:
        return 0
    seen: set[int] = set()
    total = sum(_bytes(_all(m), seen) for m in _modules(pipe).values())
    if mode != "stream":
        return total
    planned = _applied_plan(pipe)
    return max(total - planned.always - planned.resident, 0)


def _applied_plan(pipe: Any) -> stream_plan.StreamPlan:
    """The plan of the streamer applied to ``pipe``'s denoiser, re-sized from its loaded modules."""
    streamer = getattr(_denoiser(pipe)[1], streaming.ATTRIBUTE, None)
    if streamer is None:
        raise PipelineError("offload=stream: the denoiser has no streamer applied")
    blocks, always, others = stream_sizes(pipe)
    return stream_plan.plan(blocks, always, others, streamer.plan.resident_blocks, streamer.plan.depth)
