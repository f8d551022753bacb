"""Where a start's time went, as one log line: a slow first image is read off it rather than guessed.

The worker times its start (imports, CUDA, the arena, the model, the warm-up) and a diffusers model
times its own load inside that (the files, the sibling pipelines, the move to the device): an H200
worker's start took ~22 s, and such a line is what found where (docs/benchmarks.md, the cold start of
2026-12-04 and 2026-12-05).
"""

from __future__ import annotations

import time


class Phases:
    """Consecutive spans, each named when it ends."""

    def __init__(self) -> None:
        self.t0 = self.last = time.perf_counter()
        self.parts: list[str] = []

    def mark(self, what: str) -> None:
        now = time.perf_counter()
        self.parts.append(f"{what} {(now - self.last) * 1000:.0f} ms")
        self.last = now

    def total_ms(self) -> float:
        return (self.last - self.t0) * 1000

    def __str__(self) -> str:
        return ", ".join(self.parts)
