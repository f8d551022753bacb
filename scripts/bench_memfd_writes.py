"""Why ``Client.update_weights`` packs a large update into several memfds (issue 29): ``pwrite`` to one memfd
holds that file's lock, so threads writing one memfd take turns; a memfd per thread does not.

    python scripts/bench_memfd_writes.py [--gib 1] [--threads 2] [--rounds 3]

Writes the same bytes three ways, each round in a fresh memfd: one thread into one memfd, N threads into one
memfd, N threads into N memfds (one each), in 32 MiB chunks as ``client/weights.pack`` does. Prints one JSON
object with each way's seconds per round.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

_CHUNK = 32 << 20


def write(src: np.ndarray, threads: int, memfds: int) -> float:
    fds = [os.memfd_create("bench-memfd-writes", os.MFD_CLOEXEC) for _ in range(memfds)]
    try:
        for fd in fds:
            os.ftruncate(fd, src.nbytes)
        t0 = time.perf_counter()

        def one(i: int) -> None:
            fd, start = fds[i % memfds], i * _CHUNK
            view, done = src[start:start + _CHUNK].data, 0
            while done < len(view):
                done += os.pwrite(fd, view[done:], start + done)

        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, range(-(-src.nbytes // _CHUNK))))
        return time.perf_counter() - t0
    finally:
        for fd in fds:
            os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    src = np.random.default_rng(0).integers(0, 255, int(args.gib * (1 << 30)), dtype=np.uint8)
    ways = {"1 thread, 1 memfd": (1, 1), f"{args.threads} threads, 1 memfd": (args.threads, 1),
            f"{args.threads} threads, {args.threads} memfds": (args.threads, args.threads)}
    out: dict[str, list[float]] = {k: [] for k in ways}
    for _ in range(args.rounds):  # the ways in turn, so load on the machine falls on each alike
        for name, (threads, memfds) in ways.items():
            out[name].append(round(write(src, threads, memfds), 3))
    print(json.dumps({"bytes": src.nbytes, "cpus": os.cpu_count(), "seconds": out}))


if __name__ == "__main__":
    main()
