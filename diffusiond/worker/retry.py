"""A batch's forward that ran out of memory, run again: once after emptying the allocator's cache, as two halves
when it holds more than one request.

Apart from ``compute.py`` because it is a policy of its own, with its own rules for the requests it ends: what
still runs out fails with ``out_of_memory`` (saying what would help), a half that fails another way or is
cancelled ends alone, and the other half keeps its outputs either way. It stays in the worker so that a retry
costs no round trip; the engine hears of it (``oom_retry``) only to send idle models on this device away
(docs/architecture.md, "Memory: other programs, and running out").
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from diffusiond.ipc.messages import Execute, Progress, RequestSpec
from diffusiond.pipelines.base import EditArrays, Interrupted, Pipeline
from diffusiond.protocol import ErrorCode
from diffusiond.worker.failures import first_line, is_fatal, is_oom, oom_message, oom_shape
from diffusiond.worker.request_endings import Endings

log = logging.getLogger("diffusiond.worker.compute")  # the compute thread's lines, named as they always were

Forward = Callable[[list[RequestSpec], list[EditArrays]], list[torch.Tensor]]
"""One forward of some of the batch's requests, with their edit inputs: their outputs, in order."""


def run_or_retry(
    batch: Execute, live: list[RequestSpec], inputs: list[EditArrays], forward: Forward, *,
    pipeline: Pipeline, endings: Endings,
) -> tuple[list[RequestSpec], list[torch.Tensor], bool]:
    """The batch's forward; out of memory, once more after emptying the allocator's cache, as two
    halves when it holds more than one request (seeds are per request, so a half gives what it
    would alone). What still runs out fails with ``out_of_memory``; the rest goes on. A half whose
    requests are all cancelled (the finisher asks about the requests it was handed) ends those
    ``cancelled``, one that fails another way ends them with its error, and the other half keeps its
    outputs either way. Returns the requests that have outputs, those outputs, and whether it retried (a peak
    after running out of memory is not what the shape needs). The engine hears of the retry (``oom_retry``)
    and sends idle models on this device away; the retry does not wait for that (the other models' workers
    are other processes): it helps the halves and the jobs after."""
    try:
        return live, forward(live, inputs), False
    except Exception as exc:
        if not is_oom(exc):
            raise
        first = exc
    endings.empty_cache()
    split = len(live) > 1
    log.warning("batch %d (%s) ran out of memory; retrying%s: %s", batch.batch_id, oom_shape(batch, len(live)),
                " as two halves" if split else "", first_line(first))
    endings.post(Progress(batch_id=batch.batch_id, step=0, total=batch.params.steps, oom_retry=True))
    mid = (len(live) + 1) // 2
    parts = [(live[:mid], inputs[:mid]), (live[mid:], inputs[mid:])] if split else [(live, inputs)]
    done: list[RequestSpec] = []
    outputs: list[torch.Tensor] = []
    for requests, arrays in parts:
        try:
            outputs.extend(forward(requests, arrays))
        except Interrupted as exc:
            endings.cancelled([r.request_id for r in requests], exc)
            continue
        except Exception as exc:
            if is_fatal(exc):
                raise
            if not is_oom(exc):  # this half's own failure: the other half's outputs stand
                endings.failed([r.request_id for r in requests], exc)
                continue
            endings.empty_cache()
            message = oom_message(pipeline, batch, len(live), len(requests) if split else 0, exc)
            log.warning("batch %d: %s", batch.batch_id, message)
            for r in requests:
                endings.end(r.request_id, "failed", message, code=ErrorCode.OUT_OF_MEMORY)
            continue
        done.extend(requests)
    return done, outputs, True
