"""Warm-up (``--warmup``): each shape run before READY, so its first client pays neither compilation nor capture.

``ComputeThread`` calls it on the compute thread itself, before its first batch: a compiled model's CUDA graphs
belong to the thread that captured them, and the shapes compiled there are the ones later batches replay.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np
import torch

import diffusiond.pipelines.ltx2 as ltx2
from diffusiond.ipc.messages import BatchParams, WarmupShape
from diffusiond.pipelines.base import EditingPipeline, Pipeline
from diffusiond.protocol import EDIT_TASKS, VIDEO_TASKS, Task

log = logging.getLogger(__name__)


def warm_up(pipeline: Pipeline, shapes: Sequence[WarmupShape], cuda: bool) -> None:
    """Run each warm-up shape, twice where CUDA-graph trees record a graph on its second run
    (``warmup_runs``), so the first client of that shape pays neither compilation nor capture.
    Smallest batch first: a compiled model runs a batch padded into a larger graph of its size once
    it has one (pipelines/compile.py), so ``512x512:8,512x512:1`` in that order would never compile the 1."""
    caps = pipeline.capabilities
    frames = caps.num_frames if caps.task in {t.value for t in VIDEO_TASKS} else None
    # a model whose own task is an edit (Flux Kontext, Qwen-Image-Edit, a dedicated inpainting one) runs nothing
    # without an input image: it warms up on a grey one, through the edit path its jobs take
    edit = caps.task if caps.task in {t.value for t in EDIT_TASKS} else None
    for shape in sorted(shapes, key=lambda s: s.batch):
        params = BatchParams(width=shape.width, height=shape.height, steps=max(2, caps.min_steps),
                             guidance=caps.guidance, num_frames=frames, edit=edit)
        requests = ltx2.as_served(caps, "warm-up", range(shape.batch), "warmup-")  # its sound too, as a job's
        grey = np.full((shape.height, shape.width, 3), 128, np.uint8)
        whole = np.full((shape.height, shape.width, 1), 255, np.uint8) if edit == Task.INPAINTING.value else None
        t0 = time.perf_counter()
        for _ in range(getattr(pipeline, "warmup_runs", 1)):
            with torch.inference_mode():
                if edit is None:
                    pipeline.run(params, requests, lambda _step, _total: True)
                else:
                    assert isinstance(pipeline, EditingPipeline)
                    pipeline.edit(params, requests, [(grey, whole)] * len(requests), lambda _step, _total: True)
        if cuda:
            torch.cuda.synchronize()
        log.info("warmed up %dx%d batch %d in %.1f s", shape.width, shape.height, shape.batch,
                 time.perf_counter() - t0)
