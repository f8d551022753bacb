"""The model's LoRA adapters and component weights as its batches see them, changed between forwards only.

Which adapters act on a forward is the batch's (``activate``); a new adapter is registered (ADD_LORA) and a
live update applied (UPDATE_LORA, UPDATE_WEIGHTS; ``weights.py`` reads and checks it) by the compute thread
between batches, so a batch runs entirely before or entirely after any change and never sees another
batch's adapters. The versions each batch ran with travel in its COMPUTE_DONE, per output.

Apart from ``compute.py`` because none of it is the forward pass: it is what the forward runs with.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from diffusiond.ipc.messages import Ack, AddLora, Kind, LoraRef, UpdateLora, UpdateWeights
from diffusiond.pipelines.base import Pipeline, PipelineError
from diffusiond.pipelines.loras import Adapters, unsupported
from diffusiond.worker.weights import apply_update, apply_weights, mapped_tensors, read_tensors


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
            self.adapters.activate(loras)
        elif loras:
            raise PipelineError(unsupported(self.pipeline))

    def add(self, item: AddLora) -> None:
        """Register an adapter between batches: ACK ok, or not ok with why it does not fit."""
        why = unsupported(self.pipeline) if self.adapters is None else self.adapters.register(item.name, item.path)
        self.post(Ack(command=Kind.ADD_LORA, ok=not why, message=why))

    def update(self, msg: UpdateLora | UpdateWeights, fds: list[int]) -> None:
        """Apply a live LoRA or component update between batches: ACK ok, or not ok naming the first bad tensor."""
        for extra in fds[1:]:
            os.close(extra)
        kind = Kind.UPDATE_WEIGHTS if isinstance(msg, UpdateWeights) else Kind.UPDATE_LORA
        if not fds:
            self.post(Ack(command=kind, ok=False, message="the update came without its memfd"))
            return
        try:
            if isinstance(msg, UpdateWeights):
                with mapped_tensors(msg, fds[0]) as views:  # copied once, from the memfd into the parameters
                    why = apply_weights(self.pipeline, msg, views)
                if not why:
                    self.weight_versions[msg.component] = msg.version
            else:
                state = read_tensors(msg, fds[0])
                why = unsupported(self.pipeline) if self.adapters is None else \
                    apply_update(self.adapters, self.pipeline.name, msg, state)
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}"
        self.post(Ack(command=kind, ok=not why, message=why))

    def loaded(self) -> list[str]:
        return list(self.adapters.loaded) if self.adapters is not None else []
