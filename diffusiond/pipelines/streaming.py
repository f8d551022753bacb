"""``offload=stream``: a denoiser bigger than its budget, most blocks resident and the rest through a ring.

diffusers' group offloading streams every block of the denoiser every step and prefetches one group ahead,
so a block's copy overlaps only the previous block's compute, and the whole model crosses the bus each step:
FLUX.1-dev's 23 GB at ~50 GB/s is ~0.46 s a step against 0.175 s of compute (docs/benchmarks.md). Here the
blocks the budget has room for stay on the device (``stream_plan.py`` picks which), and only the others are
copied, through a ring of ``depth`` device slots on a side CUDA stream, so the bus runs continuously:

- each streamed block's tensors live in one page-locked host buffer (registered with CUDA once, as
  ``hostcopy.py``'s is: the weights exist once in host memory), laid out as they are in a slot: every
  tensor at an aligned offset, so a block crosses the bus as one contiguous copy;
- a pre-forward hook on a streamed block makes the compute stream wait for its copy and points its
  parameters' ``.data`` at views into its slot; the post-forward hook points them back at their host
  home, records the slot's free event on the compute stream, and enqueues the copy of the streamed block
  ``depth`` places ahead into that slot, on the copy stream, after that event. Then a block's copy can
  start as soon as a slot is free and overlaps the compute of everything that runs before it is needed,
  and a step costs about max(its compute, its streamed bytes' bus time) instead of their sum;
- the order is cyclic: after the last streamed block of a forward the ring goes on with the first ones,
  so the next forward's (next step's) first copies overlap this one's tail and the scheduler's step.

Between forwards the streamed parameters point at their host home, not into the ring: a slot holds another
block's weights a moment after its own forward, so anything that reads a parameter outside the forward (a
live weight update, ``state_dict``, a debugger) would read the wrong tensor there. An in-place update of a
streamed weight lands in the host buffer, which every later copy reads; ``weights_changed`` drops the
copies the ring already made of the old values.

The denoiser's forward hooks keep the ring in step with it: a forward that skips blocks (a cache that
reuses a block's output) or ends early (an exception) has the blocks it did not run released in order, so
the next forward always starts at the first streamed block, and a block that runs out of order is an error
that names it, never a block computed with another block's weights. Exact: the same bytes reach the same
kernels at equally aligned addresses, so outputs are byte-equal to the resident model's. On a CPU the same
bookkeeping runs with plain copies, no streams, no events: the tests check it there.
"""

from __future__ import annotations

import functools
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

import diffusiond.pipelines.hostcopy as hostcopy
import diffusiond.pipelines.stream_plan as stream_plan
from diffusiond.ipc import cuda_host
from diffusiond.pipelines.errors import PipelineError
from diffusiond.pipelines.hostcopy import HostCopy

ATTRIBUTE = "_diffusiond_streamer"  # the streamer of a denoiser, found by offload.device_bytes and weights


def block_lists(denoiser: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The denoiser's direct children that are lists of blocks, in the order they were registered (which
    is the order they run in, for the transformers and UNets diffusers ships)."""
    return [(n, c) for n, c in denoiser.named_children()
            if isinstance(c, torch.nn.ModuleList | torch.nn.Sequential) and all(k.isdigit() for k in c._modules)]


def blocks_of(denoiser: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """``LIST.INDEX`` -> block, in execution order: those with weights, the ones a file's header names too."""
    return {f"{name}.{key}": block for name, blocks in block_lists(denoiser) for key, block in blocks._modules.items()
            if block is not None and tensors_of(block)}


def tensors_of(module: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.Tensor, bool]]:
    """(owner, name, tensor, is_parameter) for every parameter and buffer under ``module``, each once
    (``hostcopy.tensors_of``'s walk, which residency's moves use too)."""
    return list(hostcopy.tensors_of([module]))


def tensor_bytes(module: torch.nn.Module) -> list[int]:
    return [t.numel() * t.element_size() for _, _, t, _ in tensors_of(module)]


def outside_blocks(denoiser: torch.nn.Module) -> list[torch.nn.Module]:
    """The denoiser's children that are not lists of blocks: always on the device."""
    lists = {id(c) for _, c in block_lists(denoiser)}
    return [c for c in denoiser.children() if id(c) not in lists]


def always_bytes(denoiser: torch.nn.Module) -> int:
    own = [t for t in [*denoiser._parameters.values(), *denoiser._buffers.values()] if t is not None]
    return sum(t.numel() * t.element_size() for t in own) + sum(sum(tensor_bytes(c)) for c in outside_blocks(denoiser))


@dataclass
class _Tensor:
    owner: torch.nn.Module
    name: str
    is_param: bool
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: torch.Size


@dataclass
class _Block:
    name: str
    module: torch.nn.Module
    tensors: list[_Tensor]
    size: int  # bytes in a slot, tensors aligned
    host: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.uint8))
    homes: list[torch.Tensor] = field(default_factory=list)


def _views(flat: torch.Tensor, tensors: list[_Tensor]) -> list[torch.Tensor]:
    return [flat[t.offset:t.offset + t.nbytes].view(t.dtype).view(t.shape) for t in tensors]


def _point(block: _Block, views: list[torch.Tensor]) -> None:
    for t, v in zip(block.tensors, views, strict=True):
        if t.is_param:
            param = t.owner._parameters[t.name]
            assert param is not None
            param.data = v
        else:
            t.owner._buffers[t.name] = v


class BlockStreamer:
    """Keeps ``resident_blocks`` of the denoiser's blocks on ``device`` and streams the rest (module doc)."""

    def __init__(self, denoiser: torch.nn.Module, device: torch.device | str, resident_blocks: int,
                 depth: int = stream_plan.DEPTH) -> None:
        self.device = torch.device(device)
        self.denoiser = denoiser
        named = blocks_of(denoiser)
        if not named:
            raise PipelineError(f"offload=stream: {type(denoiser).__name__} has no lists of blocks (direct children "
                                "that are ModuleLists) to stream; use offload=group or model for it")
        if isinstance(resident_blocks, bool) or not isinstance(resident_blocks, int) or resident_blocks < 0 \
                or resident_blocks > len(named):
            raise PipelineError(f"resident_blocks={resident_blocks}: {type(denoiser).__name__} has {len(named)} "
                                f"blocks; give 0 to {len(named)}")
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise PipelineError(f"offload=stream: a ring depth of {depth!r} slots; give 1 or more")
        _check(denoiser, named)
        sizes = {name: tensor_bytes(block) for name, block in named.items()}
        self.plan = stream_plan.plan(sizes, always_bytes(denoiser), 0, resident_blocks, depth)
        chosen = set(self.plan.streamed)
        self.blocks = [self._layout(name, block) for name, block in named.items() if name in chosen]
        self.resident = [block for name, block in named.items() if name not in chosen]
        self.copies = 0  # block copies enqueued (tests count them)
        self.host_bytes = 0
        self._ring: torch.Tensor | None = None
        self._queue: deque[tuple[int, int]] = deque()  # (streamed position, slot) copied or being copied
        self._next = 0  # the streamed position whose copy comes next
        self._active: int | None = None  # the position whose parameters point into its slot now
        self._last = -1  # inside a forward of the denoiser: the last position run in it
        self._in_forward = False
        self._slot_views: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._hostcopy: HostCopy | None = None
        cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if cuda else None
        self._copied = [torch.cuda.Event() for _ in range(self.plan.depth)] if cuda else []
        self._freed = [torch.cuda.Event() for _ in range(self.plan.depth)] if cuda else []
        self._home()
        self._place()
        self._handles = [denoiser.register_forward_pre_hook(self._begin),
                         denoiser.register_forward_hook(self._end, always_call=True)]
        for pos, b in enumerate(self.blocks):
            self._handles.append(b.module.register_forward_pre_hook(functools.partial(self._enter, pos)))
            self._handles.append(b.module.register_forward_hook(functools.partial(self._exit, pos), always_call=True))
        setattr(denoiser, ATTRIBUTE, self)

    @staticmethod
    def _layout(name: str, module: torch.nn.Module) -> _Block:
        tensors, offset = [], 0
        for owner, attr, t, is_param in tensors_of(module):
            n = t.numel() * t.element_size()
            tensors.append(_Tensor(owner, attr, is_param, offset, n, t.dtype, t.shape))
            offset += stream_plan.aligned(n)
        return _Block(name, module, tensors, offset)

    def _home(self) -> None:
        """Every streamed tensor copied into one host buffer (registered with CUDA) and pointed at its view."""
        total = sum(b.size for b in self.blocks)
        flat = torch.empty(total, dtype=torch.uint8)
        if self.device.type == "cuda" and total:  # unpinned when this streamer goes, before the buffer is freed
            cuda_host.register_for(self, flat.data_ptr(), total)
        self.host_bytes = total
        self._host = flat  # kept (and registered) for the model's life
        start = 0
        for b in self.blocks:
            b.host = flat[start:start + b.size]
            b.homes = _views(b.host, b.tensors)
            with torch.no_grad():
                for t, home in zip(b.tensors, b.homes, strict=True):
                    current = t.owner._parameters[t.name] if t.is_param else t.owner._buffers[t.name]
                    assert current is not None
                    home.copy_(current.detach())
            _point(b, b.homes)
            start += b.size

    def _place(self) -> None:
        """Everything but the streamed blocks onto the device (parameters keep their identity)."""
        for module in [*outside_blocks(self.denoiser), *self.resident]:
            module.to(self.device)
        for p in self.denoiser._parameters.values():
            if p is not None:
                p.data = p.data.to(self.device)
        for name, b in self.denoiser._buffers.items():
            if b is not None:
                self.denoiser._buffers[name] = b.to(self.device)

    # the ring ---------------------------------------------------------------------------------------
    def _prime(self) -> None:
        """The ring (allocated if it is not) filled with the first ``depth`` streamed blocks."""
        if self._ring is None:
            with torch.inference_mode(False):  # the worker's forwards run in inference mode: a normal tensor
                self._ring = torch.empty(self.plan.ring, dtype=torch.uint8, device=self.device)  # takes copies in both
            self._slot_views.clear()
        if self._stream is not None:  # the ring's memory may be what the compute stream's last kernels freed
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        self._queue.clear()
        self._next = 0
        for slot in range(self.plan.depth):
            self._copy(slot)

    def _copy(self, slot: int) -> None:
        pos = self._next
        block = self.blocks[pos]
        assert self._ring is not None
        start = slot * self.plan.slot
        dst = self._ring[start:start + block.size]
        if self._stream is not None:
            with torch.cuda.stream(self._stream):
                self._stream.wait_event(self._freed[slot])  # the compute stream is done with the slot
                dst.copy_(block.host, non_blocking=True)
                self._copied[slot].record(self._stream)
        else:
            dst.copy_(block.host)
        self._queue.append((pos, slot))
        self._next = (pos + 1) % len(self.blocks)
        self.copies += 1

    def _release(self) -> None:
        """The head of the ring is done with (run, or skipped): its slot takes the next block's copy."""
        _, slot = self._queue.popleft()
        if self._stream is not None:
            self._freed[slot].record(torch.cuda.current_stream(self.device))
        self._copy(slot)

    def _rewind(self) -> None:
        """Release the blocks this forward did not run, so the next one starts at the first streamed block."""
        while self._queue and self._queue[0][0] != 0:
            self._release()

    # hooks ------------------------------------------------------------------------------------------
    def _begin(self, module: torch.nn.Module, args: Any) -> None:
        if not self.blocks:
            return
        if not self._queue:
            self._prime()
        self._rewind()
        self._in_forward, self._last = True, -1

    def _end(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self._in_forward = False
        if not self.blocks:
            return
        if self._active is not None:  # a block's forward raised before its own hook could put it back
            self._exit(self._active, module, args, output)
        self._rewind()

    def _enter(self, pos: int, module: torch.nn.Module, args: Any) -> None:
        if torch.is_grad_enabled():
            raise PipelineError("offload=stream runs for inference only (under torch.no_grad): a streamed "
                                "block's slot is reused as soon as its forward ends, which a backward pass needs")
        if not self._queue:
            self._prime()
        head = self._queue[0][0]
        if pos <= self._last if self._in_forward else pos < head:
            after = self.blocks[self._last if self._in_forward else head - 1].name
            raise PipelineError(f"offload=stream: block {self.blocks[pos].name} ran out of order (after {after}); "
                                "the denoiser must run its listed blocks once each, in order, to be streamed: use "
                                "offload=group for it")
        while self._queue[0][0] != pos:  # blocks this forward skipped
            self._release()
        slot = self._queue[0][1]
        if self._stream is not None:
            torch.cuda.current_stream(self.device).wait_event(self._copied[slot])
        views = self._slot_views.get((pos, slot))
        if views is None:
            assert self._ring is not None
            start = slot * self.plan.slot
            views = _views(self._ring[start:start + self.plan.slot], self.blocks[pos].tensors)
            self._slot_views[(pos, slot)] = views
        _point(self.blocks[pos], views)
        self._active = self._last = pos

    def _exit(self, pos: int, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._active != pos:
            return
        _point(self.blocks[pos], self.blocks[pos].homes)
        self._active = None
        self._release()

    # between forwards -------------------------------------------------------------------------------
    def ring_range(self) -> tuple[int, int]:
        """[start, end) addresses of the ring (tests: a streamed parameter points there only while it runs)."""
        if self._ring is None:
            return (0, 0)
        return (self._ring.data_ptr(), self._ring.data_ptr() + self._ring.numel())

    def host_range(self) -> tuple[int, int]:
        return (self._host.data_ptr(), self._host.data_ptr() + self._host.numel())

    def weights_changed(self) -> None:
        """A streamed weight was written in place (in its host home): copies made before are stale."""
        self._drain()
        self._queue.clear()

    def _drain(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()
            torch.cuda.current_stream(self.device).synchronize()

    def leave(self) -> None:
        """Everything off the device (the model sleeps): the ring freed, resident parts to pinned host memory."""
        self._drain()
        self._queue.clear()
        self._ring = None
        self._slot_views.clear()
        self._resident_copy().leave()

    def come_back(self) -> None:
        """The resident parts back on the device; the ring is made again by the next forward."""
        self._resident_copy().come_back()

    def _resident_copy(self) -> HostCopy:
        if self._hostcopy is None:
            self._hostcopy = HostCopy([*outside_blocks(self.denoiser), *self.resident], self.device,
                                      shallow=[self.denoiser])
        return self._hostcopy


def weights_changed(module: torch.nn.Module) -> None:
    """Tell ``module``'s streamer, if it has one, that weights were written in place."""
    streamer = getattr(module, ATTRIBUTE, None)
    if isinstance(streamer, BlockStreamer):
        streamer.weights_changed()


def _check(denoiser: torch.nn.Module, named: dict[str, torch.nn.Module]) -> None:
    """Refuse what streaming cannot carry exactly: another library's hooks that move or cast weights
    (fp8-storage, accelerate's offload), quantized tensor types, strided tensors, and tensors shared across
    blocks (each block is copied alone)."""
    for module in denoiser.modules():
        registry = getattr(module, "_diffusers_hook", None)  # diffusers leaves an empty one after a call
        if getattr(module, "_hf_hook", None) is not None or getattr(registry, "hooks", None):
            raise PipelineError(f"offload=stream: {type(denoiser).__name__} already carries hooks that move or cast "
                                "its weights (quant=...:fp8-storage, another offload); stream an unquantized "
                                "denoiser, or use offload=group")
    owners: dict[int, str] = {}
    for name, block in named.items():
        for _, attr, t, _ in tensors_of(block):
            if type(t) not in (torch.Tensor, torch.nn.Parameter) or type(t.data) is not torch.Tensor:
                raise PipelineError(f"offload=stream: {name}.{attr} is a {type(t).__name__} (a quantized weight); "
                                    "only plain tensors are streamed: use offload=group for a quantized denoiser")
            if not t.is_contiguous():  # a slot holds it contiguous: other strides could pick other kernels
                raise PipelineError(f"offload=stream: {name}.{attr} is not contiguous in memory; a slot would hold "
                                    "it with other strides, and outputs must not change: use offload=group")
            if id(t) in owners and owners[id(t)] != name:
                raise PipelineError(f"offload=stream: {name} shares a tensor with {owners[id(t)]}; blocks that share "
                                    "weights cannot be streamed one at a time: use offload=group")
            owners[id(t)] = name
    rest = [t for child in outside_blocks(denoiser) for _, _, t, _ in tensors_of(child)]
    rest += [t for t in [*denoiser._parameters.values(), *denoiser._buffers.values()] if t is not None]
    for t in rest:
        if id(t) in owners:
            raise PipelineError(f"offload=stream: {owners[id(t)]} shares a tensor with the rest of "
                                f"{type(denoiser).__name__}; use offload=group")
