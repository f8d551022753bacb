"""The model's LoRA adapters and component weights as its batches see them, changed between forwards only.

Which adapters act on a forward is the batch's (``activate``); a new adapter is registered (ADD_LORA) and a
live update applied (UPDATE_LORA, UPDATE_WEIGHTS; ``weights.py`` reads and checks it) by the compute thread
between batches, so a batch runs entirely before or entirely after any change and never sees another
batch's adapters. The versions each batch ran with travel in its COMPUTE_DONE, per output.

Apart from ``compute.py`` because none of it is the forward pass: it is what the forward runs with.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from diffusiond.ipc.messages import Ack, AddLora, Kind, LoraRef, UpdateLora, UpdateWeights, WeightTensor
from diffusiond.ipc.tensors import nbytes
from diffusiond.pipelines.base import Pipeline, PipelineError
from diffusiond.pipelines.errors import HalfApplied
from diffusiond.pipelines.loras import Adapters, unsupported
from diffusiond.pipelines.phases import Phases
from diffusiond.worker.failures import first_line, is_oom
from diffusiond.worker.weights import apply_update, apply_weights, read_tensors

log = logging.getLogger("diffusiond.worker")


class AdapterOutOfMemory(PipelineError):
    """A batch's LoRA did not fit in what the device had left as it was loaded: the batch's jobs end
    ``out_of_memory`` (the job's problem, as a forward's), with this message, not ``generation_failed``."""


def _nbytes(t: WeightTensor) -> int:
    try:
        return nbytes(t.dtype, t.shape)
    except KeyError:  # refused by the engine before it reached here; a log line is no place to fail
        return 0


class LiveAdapters:
    def __init__(self, pipeline: Pipeline, adapters: Adapters | None, post: Callable[..., None]) -> None:
        self.pipeline = pipeline
        self.adapters = adapters
        self.post = post
        # the version of each component update_weights changed, as applied here (what a batch runs with)
        self.weight_versions: dict[str, int] = {}

    def versions(self, loras: tuple[LoraRef, ...]) -> dict[str, int]:
        """The version of each of a batch's adapters it ran with (0: never updated)."""
        versions = self.adapters.versions if self.adapters is not None else {}
        return {r.name: versions.get(r.name, 0) for r in loras}

    def activate(self, loras: tuple[LoraRef, ...]) -> None:
        """The batch's LoRA adapters, and only those, act on its forward (none: the base model).
        The one place adapters change; here, between forwards, so no batch sees another's."""
        if self.adapters is not None:
            # what this batch loads, which is what can run out (all of them: the switch itself ran out)
            new = [r.name for r in loras if r.name not in self.adapters.loaded] or [r.name for r in loras]
            try:
                self.adapters.activate(loras)
            except Exception as exc:
                if not is_oom(exc):
                    raise
                what = f"LoRA{'s' if len(new) > 1 else ''} {', '.join(repr(n) for n in new)}"
                raise AdapterOutOfMemory(
                    f"out of memory loading {what} into model {self.pipeline.name} on {self.pipeline.device}: "
                    f"{first_line(exc)}. What would help: fewer LoRAs kept loaded (--max-loras), fewer models or "
                    "other programs on the device (--device-memory), or a LoRA of a lower rank") from exc
        elif loras:
            raise PipelineError(unsupported(self.pipeline))

    def add(self, item: AddLora) -> None:
        """Register an adapter between batches: ACK ok, or not ok with why it does not fit."""
        try:
            why = unsupported(self.pipeline) if self.adapters is None else self.adapters.register(item.name, item.path)
        except Exception as exc:  # answered: raised, it ended the compute thread and every batch after waited
            why = f"registering adapter {item.name!r} failed: {type(exc).__name__}: {exc}"
        self.post(Ack(command=Kind.ADD_LORA, ok=not why, message=why, ack_id=item.ack_id))

    def update(self, msg: UpdateLora | UpdateWeights, fds: list[int]) -> None:
        """Apply a live LoRA or component update between batches (``fds``: its parts, all closed here): ACK ok,
        or not ok naming the first bad tensor."""
        kind = Kind.UPDATE_WEIGHTS if isinstance(msg, UpdateWeights) else Kind.UPDATE_LORA
        # the engine checked every part against these fds; a mismatch here is a bug, said, not a crash
        bad = next((t.name for t in msg.tensors if not 0 <= t.part < len(fds)), None)
        if not fds or bad is not None:
            for fd in fds:
                os.close(fd)
            why = "the update came without its memfd" if not fds else \
                f"tensor {bad!r} lies in a part the update did not bring ({len(fds)} memfd(s) came)"
            self.post(Ack(command=kind, ok=False, message=why, ack_id=msg.ack_id))
            return
        phases = Phases()
        try:
            if isinstance(msg, UpdateWeights):
                try:  # read once, memfd to parameters
                    why = apply_weights(self.pipeline, msg, fds, phases.mark)
                finally:
                    for fd in fds:
                        os.close(fd)
                if not why:
                    self.weight_versions[msg.component] = msg.version
            else:
                state = read_tensors(msg, fds)
                phases.mark("read")
                why = unsupported(self.pipeline) if self.adapters is None else \
                    apply_update(self.adapters, self.pipeline.name, msg, state)
                phases.mark("checked and applied")
        except HalfApplied as exc:  # the model holds parts of two versions: this worker is done
            self.post(Ack(command=kind, ok=False, ack_id=msg.ack_id, restarts=True,
                          message=f"the copy failed after it began ({exc}); the worker restarts from the files and "
                                  "the updates accepted before this one"))
            raise
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}"
        self.post(Ack(command=kind, ok=not why, message=why, ack_id=msg.ack_id))
        # issue 29's update_lora target (<= 200 ms to the first job) was missed at 0.8 s on an H100: the
        # worker's share of it, named, as the start's line names a cold start's
        what = msg.name if isinstance(msg, UpdateLora) else f"{msg.model}/{msg.component}"
        log.info("%s %s version %d: %s (%d tensors, %d MB)%s", kind.name.lower(), what, msg.version, phases,
                 len(msg.tensors), sum(_nbytes(t) for t in msg.tensors) >> 20, f"; refused: {why}" if why else "")

    def loaded(self) -> list[str]:
        return list(self.adapters.loaded) if self.adapters is not None else []
