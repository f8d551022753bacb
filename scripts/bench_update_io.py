"""The host side of a live update (issue 29's ``update_lora`` latency): the client packing a state dict into its
memfd and a worker reading it back, for the rank-R adapter ``bench_live.py lora`` sends, timed against the way
both sides did it before (through a mapping, and torch's ``isfinite``), alternating in one process.

    python scripts/bench_update_io.py --preset flux-dev --component transformer --rank 64 --rounds 5

``--kind weights`` times a whole component's update instead (``update_weights``: SDXL's UNet with ``--preset sdxl
--component unet --dtype float16``): the pack into one memfd by one thread against the pack now (several memfds,
a thread each), and the worker's copy from the memfds into the component's parameters: through a private writable
mapping (first), a shared populated one (until 2026-12-06's third session), and read in place now
(``worker/update_copy.py``), the parameters on this machine's CPU.

Prints one JSON object: the medians in seconds, and the bytes.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_live import full_state, lora_state

import diffusiond.client.weights as client_weights
from diffusiond.client.weights import pack
from diffusiond.ipc.messages import UpdateLora, UpdateWeights
from diffusiond.ipc.tensors import numpy_dtype
from diffusiond.pipelines.preset_tables import get_preset
from diffusiond.pipelines.presets import build_part
from diffusiond.worker import update_copy
from diffusiond.worker.weights import read_tensors


def pack_mapped(state: dict[str, torch.Tensor]) -> tuple[int, list]:
    """The client's pack before: torch's isfinite per tensor, the memfd written through a mapping."""
    arrays = []
    for v in state.values():
        assert bool(v.isfinite().all())
        arrays.append(v.view(torch.int16).numpy() if v.dtype == torch.bfloat16 else v.numpy())
    total = sum(-(-a.nbytes // 64) * 64 for a in arrays)
    fd = os.memfd_create("bench", os.MFD_CLOEXEC)
    os.ftruncate(fd, total)
    offsets, offset = [], 0
    with mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as mm:
        for a in arrays:
            mm[offset:offset + a.nbytes] = a.reshape(-1).view(np.uint8).data
            offsets.append(offset)
            offset += -(-a.nbytes // 64) * 64
    return fd, offsets


def read_mapped(msg: UpdateLora, fds: list[int]) -> None:
    """The worker's read before: a copy of each tensor out of a mapping (the fds are left open)."""
    for part, fd in enumerate(fds):
        with mmap.mmap(fd, os.fstat(fd).st_size, mmap.MAP_SHARED, mmap.PROT_READ) as mm:
            for t in msg.tensors:
                if t.part == part:
                    np.frombuffer(mm, dtype=numpy_dtype(t.dtype), count=int(np.prod(t.shape)), offset=t.offset).copy()


def copy_private(msg: UpdateWeights, fds: list[int], into: dict[str, torch.Tensor]) -> None:
    """The worker's copy before: the memfds mapped private and writable, each tensor copied from them (the fds
    are left open)."""
    maps = [mmap.mmap(fd, os.fstat(fd).st_size, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE) for fd in fds]
    for t in msg.tensors:
        dtype = into[t.name].dtype
        into[t.name].copy_(torch.frombuffer(maps[t.part], dtype=dtype, count=int(np.prod(t.shape)), offset=t.offset)
                           .view(t.shape))


def copy_mapped(msg: UpdateWeights, fds: list[int], into: dict[str, torch.Tensor]) -> None:
    """The worker's copy until the memfds were sealed: mapped shared and populated, each tensor copied out."""
    maps = [mmap.mmap(fd, os.fstat(fd).st_size, mmap.MAP_SHARED | mmap.MAP_POPULATE, mmap.PROT_READ) for fd in fds]
    for t in msg.tensors:
        dtype = into[t.name].dtype
        into[t.name].copy_(torch.frombuffer(maps[t.part], dtype=dtype, count=int(np.prod(t.shape)), offset=t.offset)
                           .view(t.shape))


def weights_rounds(state: dict[str, torch.Tensor], rounds: int) -> dict[str, list[float]]:
    into = {k: torch.empty_like(v) for k, v in state.items()}
    times: dict[str, list[float]] = {"pack_one_thread": [], "pack_now": [], "copy_before": [], "copy_mapped": [],
                                     "copy_now": []}
    for _ in range(rounds):
        parts = client_weights._MAX_PARTS
        client_weights._MAX_PARTS = 1  # one memfd, so one thread
        t0 = time.perf_counter()
        fds, _ = pack(state)
        t1 = time.perf_counter()
        client_weights._MAX_PARTS = parts
        for fd in fds:
            os.close(fd)
        fds, tensors = pack(state)
        t2 = time.perf_counter()
        msg = UpdateWeights("bench", "component", tensors)
        copy_private(msg, fds, into)
        t3 = time.perf_counter()
        copy_mapped(msg, fds, into)
        t4 = time.perf_counter()
        update_copy.copy_into([(into[t.name], update_copy.Source(fds[t.part], t)) for t in tensors])
        t5 = time.perf_counter()
        for fd in fds:
            os.close(fd)
        for key, seconds in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4), strict=True):
            times[key].append(seconds)
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="flux-dev")
    ap.add_argument("--component", default="transformer")
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--kind", choices=("lora", "weights"), default="lora")
    args = ap.parse_args()
    component = build_part(get_preset(args.preset).parts[args.component], "meta")
    if args.kind == "weights":
        state = full_state(component, getattr(torch, args.dtype), "cpu")
        times = weights_rounds(state, args.rounds)
        print(json.dumps({"kind": "weights", "preset": args.preset, "component": args.component, "tensors": len(state),
                          "bytes": sum(t.numel() * t.element_size() for t in state.values()),
                          "cpus": os.cpu_count(), "rounds": args.rounds,
                          **{k: round(statistics.median(v), 4) for k, v in times.items()}}))
        return 0
    state = lora_state(component, args.component, args.rank, getattr(torch, args.dtype))
    times: dict[str, list[float]] = {"pack_before": [], "pack_now": [], "read_before": [], "read_now": []}
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        fd, _ = pack_mapped(state)
        t1 = time.perf_counter()
        os.close(fd)
        fds, tensors = pack(state)
        t2 = time.perf_counter()
        msg = UpdateLora("bench", tensors)
        read_mapped(msg, fds)
        t3 = time.perf_counter()
        read_tensors(msg, fds)
        t4 = time.perf_counter()
        for key, seconds in zip(times, (t1 - t0, t2 - t1, t4 - t3, t3 - t2), strict=True):
            times[key].append(seconds)
    print(json.dumps({"preset": args.preset, "rank": args.rank, "tensors": len(state),
                      "bytes": sum(t.numel() * t.element_size() for t in state.values()),
                      "torch_threads": torch.get_num_threads(), "rounds": args.rounds,
                      **{k: round(statistics.median(v), 4) for k, v in times.items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
