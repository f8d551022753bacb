"""``offload=stream``'s arithmetic: which denoiser blocks stay resident, and what that keeps on the device.

Torch-free on purpose: the engine sizes a model from its files' headers (``daemon/residency/fit.py``) and
the worker sizes it from its loaded modules (``pipelines/offload.py``, ``pipelines/streaming.py``); both
call the functions here with the same tensor sizes, so the figure ``diffusiond fit`` prints, the number of
resident blocks the daemon picks at start, and the bytes residency then counts the running model at can
never disagree.

Blocks are named ``LIST.INDEX`` after the denoiser's direct children that are lists of blocks
(``transformer_blocks.3``, ``single_transformer_blocks.17``, ``down_blocks.1``). Which ones stream is a
function of the lists' names and lengths alone, because a file's header says nothing about the order the
blocks run in (safetensors headers are sorted by name); the lists are taken in name order and the
streamed blocks spread evenly over them. Spread, not the last ones: a streamed block's copy overlaps the
compute of whatever runs between the block that freed its slot and itself, and resident blocks between
streamed ones give the bus that time; with the streamed blocks bunched at the end, the bus would idle
through the resident part of every step and then hold the compute up through the streamed part.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

DEPTH = 3
"""Ring slots: one block computing, one copied in, one more for the step's boundary and uneven spacing."""
ALIGN = 512
"""Every tensor's view in a slot starts on this boundary, so any dtype's view is aligned as the caching
allocator's own allocations are (a kernel never sees a pointer it would not have seen resident)."""


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def block_bytes(tensor_bytes: Iterable[int]) -> int:
    """A block's footprint in a slot (and in the host buffer): its tensors one after another, each aligned."""
    return sum(aligned(n) for n in tensor_bytes)


def _order(name: str) -> tuple[str, int]:
    head, _, index = name.rpartition(".")
    if not head or not index.isdigit():
        raise ValueError(f"block name {name!r} is not LIST.INDEX")
    return head, int(index)


def streamed_blocks(names: Iterable[str], resident: int) -> tuple[str, ...]:
    """The blocks that stream when ``resident`` of them stay on the device: the blocks (``LIST.INDEX``) laid
    end to end, lists in name order, and the streamed ones picked evenly over them."""
    ordered = sorted(names, key=_order)
    n = len(ordered)
    if not 0 <= resident <= n:
        raise ValueError(f"resident_blocks={resident}: the denoiser has {n} blocks; give 0 to {n}")
    s = n - resident
    return tuple(ordered[(2 * i + 1) * n // (2 * s)] for i in range(s))


@dataclass(frozen=True)
class StreamPlan:
    """What ``offload=stream`` keeps on the device with ``resident_blocks`` of ``blocks`` resident."""

    resident_blocks: int
    blocks: int  # how many the denoiser has
    depth: int  # ring slots (0 when nothing streams)
    streamed: tuple[str, ...]
    always: int  # the denoiser's bytes outside its block lists: on the device for the whole forward
    resident: int  # the resident blocks' bytes
    slot: int  # one ring slot: the largest streamed block, its tensors aligned
    streamed_bytes: int  # what crosses the bus every forward
    others: int  # what the other components (leaf-level group offloading) keep there while they run

    @property
    def ring(self) -> int:
        return self.depth * self.slot

    @property
    def device_bytes(self) -> int:
        return self.always + self.resident + self.ring + self.others

    def describe(self) -> str:
        if not self.streamed:
            return f"all {self.blocks} denoiser blocks resident (nothing streamed)"
        return (f"{self.resident_blocks} of {self.blocks} denoiser blocks resident, {len(self.streamed)} streamed "
                f"through a ring of {self.depth} slots of {self.slot} bytes ({self.streamed_bytes} bytes over the "
                "bus per forward)")


def plan(blocks: Mapping[str, list[int]], always: int, others: int, resident_blocks: int,
         depth: int = DEPTH) -> StreamPlan:
    """The plan for a given number of resident blocks. ``blocks``: ``LIST.INDEX`` -> its tensors' bytes."""
    streamed = streamed_blocks(blocks, resident_blocks)
    chosen = set(streamed)
    return StreamPlan(
        resident_blocks=resident_blocks, blocks=len(blocks), depth=min(depth, len(streamed)), streamed=streamed,
        always=always, resident=sum(sum(t) for name, t in blocks.items() if name not in chosen),
        slot=max((block_bytes(blocks[name]) for name in streamed), default=0),
        streamed_bytes=sum(sum(blocks[name]) for name in streamed), others=others)


def least(blocks: Mapping[str, list[int]], always: int, others: int, depth: int = DEPTH) -> StreamPlan:
    """The plan that keeps the fewest bytes on the device (ties: the most blocks resident). Usually none
    resident; but where the ring would be larger than the blocks it saves (a small model), all of them."""
    plans = [plan(blocks, always, others, k, depth) for k in range(len(blocks), -1, -1)]
    return min(plans, key=lambda p: p.device_bytes)


def choose(blocks: Mapping[str, list[int]], always: int, others: int, fits: Callable[[int], bool],
           depth: int = DEPTH) -> tuple[StreamPlan, bool]:
    """The plan with the most resident blocks whose device bytes ``fits`` (given them, it adds the working
    memory and compares with the budget), and True; or, when none fits, the one that needs the least, and
    False."""
    for k in range(len(blocks), -1, -1):
        p = plan(blocks, always, others, k, depth)
        if fits(p.device_bytes):
            return p, True
    return least(blocks, always, others, depth), False
