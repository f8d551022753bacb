"""Does a second thread's torch op slow the parallel ops of the first? (docs/benchmarks.md)

Times ``torch.relu(x @ x)`` on 256x256 in one thread, then again after another thread has run
one large torch op (giving that thread its own OpenMP team). ``none``: no other thread;
``spawn``: the other thread has ended; ``spawn_alive``: it is still alive, as the worker's copy
thread is. Run: ``python scripts/omp_teams.py spawn_alive`` on a CPU machine.
"""

from __future__ import annotations

import sys
import threading
import time

import torch

x = torch.randn(256, 256)


def per_iteration_ms(n: int = 400) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        torch.relu(x @ x)
    return (time.perf_counter() - t0) / n * 1e3


def in_thread(key: str, res: dict[str, float]) -> None:
    t = threading.Thread(target=lambda: res.__setitem__(key, per_iteration_ms()))
    t.start()
    t.join()


def main(mode: str) -> None:
    res: dict[str, float] = {}
    in_thread("before", res)
    release = threading.Event()
    if mode in ("spawn", "spawn_alive"):

        def other() -> None:
            torch.ones(4_000_000).mul_(2)
            if mode == "spawn_alive":
                release.wait()

        threading.Thread(target=other, daemon=True).start()
        time.sleep(0.5)  # let it run its op (this is a demonstration script, not a test)
    in_thread("after", res)
    release.set()
    print(f"{mode}: {res['before']:.3f} ms per iteration before, {res['after']:.3f} ms after")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "spawn_alive")
