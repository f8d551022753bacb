"""The engine's view of one worker: what the engine and the pool may ask of it, and nothing else.

``handle.WorkerHandle`` is the real one, a process behind a channel; tests use in-process
fakes of the same shape, so the engine's transitions can be checked without processes (the way
vLLM's ``InprocClient`` runs its core).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from diffusiond.ipc.frames import Frame
from diffusiond.ipc.messages import (
    Ack,
    AddLora,
    Execute,
    Ready,
    Release,
    Shutdown,
    Sleep,
    Trace,
    UpdateLora,
    UpdateWeights,
    Wake,
    WorkerConfig,
)
from diffusiond.ipc.tensors import TensorDesc
from diffusiond.protocol import WorkerState

Command = Sleep | Wake | Shutdown | Trace | AddLora | UpdateLora | UpdateWeights | Release
"""What a worker answers with an ACK (a RELEASE only with ``host_copy``), matched to it by ``ack_id``."""


class WorkerStartError(Exception):
    """A worker did not become ready; the message says why (its FATAL, exit status or timeout)."""


class WorkerLink(Protocol):
    """The engine's handle on one worker. ``WorkerHandle`` is the real one (a process)."""

    id: int
    config: WorkerConfig
    state: WorkerState
    started_at: float
    loras_loaded: list[str]  # LoRA adapters loaded in the worker, as of its last heartbeat answer
    host_kept: int  # page-locked host copy of its weights it keeps, as of its last SLEEP, WAKE or RELEASE answer
    asked_to_stop: bool  # stop() was called (an unload, a keep_alive, a retire), not a crash

    @property
    def name(self) -> str: ...
    @property
    def pid(self) -> int | None: ...
    @property
    def arena_capacity(self) -> int: ...
    @property
    def held_bytes(self) -> int: ...
    @property
    def arena_held_bytes(self) -> int:
        """Of ``held_bytes``, the bytes in the arena's slots (not in dedicated memfds)."""
        ...

    async def start(self, timeout: float) -> Ready: ...
    async def stop(self, timeout: float) -> None: ...
    async def command(self, msg: Command, timeout: float, fds: Sequence[int] = ()) -> Ack: ...
    def execute(self, batch: Execute, fds: Sequence[int] = ()) -> None:
        """Send a batch; ``fds`` (edits' input buffers) go with it and are closed once sent."""
        ...
    def cancel(self, request_ids: list[str]) -> None: ...
    def kill(self) -> None:
        """SIGKILL: the loss callback follows, as for a crash."""
        ...
    def buffer(self, desc: TensorDesc) -> memoryview: ...
    def share(self, desc: TensorDesc) -> tuple[int, int] | None: ...
    def return_slot(self, desc: TensorDesc) -> None: ...
    def ping(self) -> None: ...
    def answering(self, within: float) -> bool: ...


FrameCallback = Callable[["WorkerLink", Frame], None]
"""A frame that concerns jobs (the handle keeps the ones about itself: HELLO, READY, ACK, FATAL)."""
LostCallback = Callable[["WorkerLink", str], None]
"""The worker ended; called once, with one sentence that says how."""
