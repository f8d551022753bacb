"""A model's weights between its device and page-locked host memory, at the bus's speed.

``module.to("cpu")`` copies each tensor into fresh pageable memory, one blocking copy after another:
7.0 s for SDXL and 32.6 s for FLUX.1-dev to leave an H200 (docs/benchmarks.md, "Residency moves",
has these figures and the ones below). Here the first time a model leaves its device its weights get
one host block, registered with CUDA once (page-locked, as the output arena is:
``ipc/cuda_host.py``) and carved into a view per tensor; the block is kept for the model's life and
reused by every later move, so a move is one asynchronous copy per tensor on a side stream and a
single wait at the end, at the copy engine's speed. One block registered, not a pinned allocation
per tensor: torch's pinned allocator rounds each allocation up to a power of two and pins tensor by
tensor, which made a first move of FLUX take 40 s on the H200. The weights exist once in host memory
(the pinned buffers), whether the model is on its device or not; the device copy is allocated again
on each return, so leaving frees the device for real.

Parameters keep their identity (``param.data`` is swapped), so adapters, hooks and compiled graphs
that hold the modules still see the same objects.

Kept, the block is host memory the model holds while back on its device, which residency counts against
``--host-memory`` (issue 27): the worker reports ``kept()`` with each answer to SLEEP and WAKE, and frees it
(``release_all``) when residency needs the room for another model: cheap (an unpin and a free), and the next
``leave`` builds the block again.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Sequence

import torch

from diffusiond.ipc import cuda_host

ALIGN = 512  # every view starts on this boundary: any dtype's view of the block is aligned

# Every host copy of this process. A worker serves one model, so these are all that model's (its pipeline's,
# offload=stream's resident part's): what the worker keeps is their sum, without asking each pipeline kind.
_LIVE: weakref.WeakSet[HostCopy] = weakref.WeakSet()


def kept() -> int:
    """Bytes of host blocks this process keeps now (whether its weights are in them or on the device)."""
    return sum(c.nbytes for c in list(_LIVE))


def release_all() -> int:
    """Every host copy of this process whose weights are on the device gives up its block; the bytes freed."""
    return sum(c.release() for c in list(_LIVE))


def tensors_of(modules: Sequence[torch.nn.Module], shallow: Sequence[torch.nn.Module] = (),
             ) -> Iterator[tuple[torch.nn.Module, str, torch.Tensor, bool]]:
    """(owner, name, tensor, is_parameter) for every parameter and buffer (of ``shallow`` modules only their
    own, not their children's), each tensor once."""
    seen: set[int] = set()
    for owners in [*(root.modules() for root in modules), *([m] for m in shallow)]:
        for module in owners:
            for name, p in module._parameters.items():
                if p is not None and id(p) not in seen:
                    seen.add(id(p))
                    yield module, name, p, True
            for name, b in module._buffers.items():
                if b is not None and id(b) not in seen:
                    seen.add(id(b))
                    yield module, name, b, False


class HostCopy:
    """The pinned host side of one model's weights; ``leave`` and ``come_back`` move them."""

    def __init__(self, modules: list[torch.nn.Module], device: torch.device,
                 shallow: list[torch.nn.Module] | None = None) -> None:
        self.modules = modules
        self.shallow = shallow or []  # modules whose own tensors move, not their children's (offload=stream's root)
        self.device = device
        self._pinned: dict[int, torch.Tensor] = {}  # id(parameter or buffer) -> its view of the host block
        self._blocks: list[torch.Tensor] = []  # kept alive (and registered) for the model's life
        self.nbytes = 0
        _LIVE.add(self)
        self._unpins: list[Callable[[], None]] = []  # per block: ``release`` unpins before it frees them

    def _carve(self, tensors: list[torch.Tensor]) -> None:
        """One host block for every tensor still without one, registered with CUDA; a view each."""
        todo = [t for t in tensors if id(t) not in self._pinned]
        if not todo:
            return
        offsets, total = [], 0
        for t in todo:
            offsets.append(total)
            total += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
        block = torch.empty(total, dtype=torch.uint8)
        if self.device.type == "cuda":  # unpinned when this copy goes with its model, if not released before
            self._unpins.append(cuda_host.register_for(self, block.data_ptr(), total))
        for t, off in zip(todo, offsets, strict=True):
            n = t.numel() * t.element_size()
            self._pinned[id(t)] = block[off:off + n].view(t.dtype).view(t.shape)
        self._blocks.append(block)
        self.nbytes += total

    def release(self) -> int:
        """Drop the block (unpinned, then freed) while the weights are on the device; the next ``leave`` makes
        one again. Nothing while any weight lives in the block (the model is away): it is all they have.
        Returns the bytes freed."""
        spans = [(b.data_ptr(), b.data_ptr() + b.numel()) for b in self._blocks]
        if any(lo <= t.data_ptr() < hi for _, _, t, _ in tensors_of(self.modules, self.shallow) for lo, hi in spans):
            return 0
        for unpin in self._unpins:
            unpin()
        self._unpins.clear()
        freed, self.nbytes = self.nbytes, 0
        self._blocks.clear()
        self._pinned.clear()
        return freed

    def leave(self) -> None:
        """Device -> pinned host; the device memory is given back to the allocator."""
        stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        moved: list[tuple[torch.nn.Module, str, torch.Tensor, bool, torch.Tensor]] = []
        with torch.cuda.stream(stream) if stream is not None else _nothing():
            if stream is not None:
                stream.wait_stream(torch.cuda.current_stream(self.device))  # the last forward is done with them
            on_device = [(o, n, t, p) for o, n, t, p in tensors_of(self.modules, self.shallow)
                         if t.device.type != "cpu"]
            self._carve([t for _, _, t, _ in on_device])
            for owner, name, t, is_param in on_device:
                host = self._pinned[id(t)]
                host.copy_(t.detach(), non_blocking=True)
                moved.append((owner, name, t, is_param, host))
        if stream is not None:
            stream.synchronize()
        for owner, name, t, is_param, host in moved:
            if is_param:
                t.data = host
            else:
                owner._buffers[name] = host
                self._pinned[id(host)] = host

    def come_back(self) -> None:
        """Pinned host -> freshly allocated device memory, one async copy each, one wait."""
        stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # Allocated on the forward's stream (whose pool will free them), filled on the side stream.
        moved = [(owner, name, t, is_param, torch.empty(t.shape, dtype=t.dtype, device=self.device))
                 for owner, name, t, is_param in tensors_of(self.modules, self.shallow) if t.device.type == "cpu"]
        with torch.cuda.stream(stream) if stream is not None else _nothing():
            if stream is not None:
                stream.wait_stream(torch.cuda.current_stream(self.device))
            for _, _, t, _, dev in moved:
                dev.copy_(t.detach(), non_blocking=True)
        if stream is not None:
            stream.synchronize()  # before the forward's stream may read them
        for owner, name, t, is_param, dev in moved:
            if is_param:
                t.data = dev
            else:
                self._pinned[id(dev)] = self._pinned.pop(id(t), t)
                owner._buffers[name] = dev


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
