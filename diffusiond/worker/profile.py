"""Kernel traces of forward passes, for contributors chasing GPU time: ``DIFFUSIOND_TORCH_PROFILE``.

``--trace`` times each forward as a whole. When a change costs a few percent and the question is
*where* (a gap on the forward's stream, a kernel on the copy thread's stream, a launch that came
late), a trace of every kernel answers it, and one profiled forward of each variant can show what
hundreds of timed ones only bound. With ``DIFFUSIOND_TORCH_PROFILE=DIR[:SKIP[:COUNT]]`` in the
daemon's environment, each worker profiles its forwards SKIP+1 to SKIP+COUNT (default: all but
the first two) with ``torch.profiler``, CUDA activity on every stream of the process included,
and writes one Chrome trace per forward, ``DIR/<pid>-b<batch>-p<preview_every>.json.gz``
(``preview_every``: the most often any request of the batch asked for previews; 0 for none).
``scripts/profile_summary.py`` reads them. The profiler slows launches: compare traces with
traces, never with timed runs.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import torch

log = logging.getLogger(__name__)

ENV = "DIFFUSIOND_TORCH_PROFILE"


class ForwardProfiler:
    def __init__(self, spec: str) -> None:
        where, _, rest = spec.partition(":")
        skip, _, count = rest.partition(":")
        try:
            self.skip = int(skip or 2)
            self.count = int(count or 1000)
        except ValueError:
            raise ValueError(f"{ENV}={spec!r}: expected DIR[:SKIP[:COUNT]] with whole numbers") from None
        self.dir = Path(where)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.seen = 0

    @contextlib.contextmanager
    def forward(self, batch_id: int, preview_every: int) -> Iterator[None]:
        self.seen += 1
        if not self.skip < self.seen <= self.skip + self.count:
            yield
            return
        cuda = torch.cuda.is_available()
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        with torch.profiler.profile(activities=activities) as prof:
            yield
            if cuda:
                torch.cuda.synchronize()  # the forward's last kernels and its previews' copies land in it
        path = self.dir / f"{os.getpid()}-b{batch_id}-p{preview_every}.json.gz"
        prof.export_chrome_trace(str(path))
        log.info("profiled batch %d into %s", batch_id, path)


def from_env() -> ForwardProfiler | None:
    spec = os.environ.get(ENV, "")
    return ForwardProfiler(spec) if spec else None
