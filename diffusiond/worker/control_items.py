"""SLEEP, WAKE, RELEASE and SHUTDOWN as the compute thread carries them out, between two batches.

Apart from ``compute.py`` because none of it is a forward pass: it is where the weights are, and whether the
thread goes on. The commands travel through the compute thread's own queue so that they run after the batches
sent before them; what they must get right is theirs alone: drain the copies first (bounded), never answer
"not ok" over weights that moved anyway, and put a sleep that failed half-way back or end the process.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import diffusiond.pipelines.hostcopy as hostcopy
from diffusiond.ipc.messages import Ack, Kind
from diffusiond.pipelines.base import Pipeline
from diffusiond.pipelines.controlnet import ControlNets
from diffusiond.pipelines.ip_adapter import IpAdapters
from diffusiond.worker.finish import Finisher
from diffusiond.worker.state import SharedState

log = logging.getLogger("diffusiond.worker.compute")  # the compute thread's lines, named as they always were


@dataclass(frozen=True)
class Control:
    command: Literal["sleep", "wake", "shutdown", "release"]
    ack_id: int = 0  # the command's, echoed in its ACK


_KIND = {"sleep": Kind.SLEEP, "wake": Kind.WAKE, "shutdown": Kind.SHUTDOWN, "release": Kind.RELEASE}


class Power:
    """A control item on the compute thread: drain the copies (bounded), move the weights, answer with an ACK.

    ``die(why, code, between_batches=)`` ends the process (the compute thread's ``_die``)."""

    def __init__(
        self,
        pipeline: Pipeline,
        finish: Finisher,
        state: SharedState,
        post: Callable[..., None],
        *,
        controlnets: ControlNets | None,
        ip_adapters: IpAdapters | None,
        drain_timeout_s: float,
        on_exit: Callable[[int], None],
        die: Callable[..., None],
    ) -> None:
        self.pipeline = pipeline
        self.finish = finish
        self.state = state
        self.post = post
        self.controlnets = controlnets
        self.ip_adapters = ip_adapters
        self.drain_timeout_s = drain_timeout_s
        self.on_exit = on_exit
        self.die = die

    def __call__(self, item: Control) -> bool:
        """Drain copies (bounded), then act. Returns True when the thread should end."""
        if item.command == "release":  # the host copy is no copy's source or target: nothing to drain
            try:
                hostcopy.release_all()
                self.post(Ack(command=Kind.RELEASE, ok=True, host_kept=hostcopy.kept(), ack_id=item.ack_id))
            except Exception as exc:  # answered: an exception here ended the thread, and every batch after waited
                self.post(Ack(command=Kind.RELEASE, ok=False, message=f"release failed: {type(exc).__name__}: "
                              f"{exc}", host_kept=hostcopy.kept(), ack_id=item.ack_id))
            return False
        self.state.record(f"drain_start_{item.command}", 0)
        drained = self.state.drain(self.drain_timeout_s)
        self.state.record(f"drain_end_{item.command}", 0)
        message = "" if drained else f"copy thread did not drain within {self.drain_timeout_s}s"
        ok = drained
        if not drained and item.command in ("sleep", "wake"):
            # nothing moves: an answer "not ok" over a model that had moved anyway left the engine sending batches
            # to a sleeping model, each failing, and its wakes to no one; the engine may ask again
            self.post(Ack(command=_KIND[item.command], ok=False, message=message, host_kept=hostcopy.kept(),
                          ack_id=item.ack_id))
            return False
        try:
            if item.command == "sleep":
                if self.ip_adapters is not None:  # out of the UNet before its weights move
                    self.ip_adapters.place(asleep=True)
                self.pipeline.sleep()
                if self.controlnets is not None:
                    self.controlnets.place(asleep=True)
                self.finish.place(asleep=True)
            elif item.command == "wake":
                self.pipeline.wake()
                if self.controlnets is not None:
                    self.controlnets.place(asleep=False)
                if self.ip_adapters is not None:
                    self.ip_adapters.place(asleep=False)
                self.finish.place(asleep=False)
        except Exception as exc:
            ok, message = False, f"{item.command} failed: {type(exc).__name__}: {exc}"
            if item.command == "sleep" and not self._undo_sleep():  # half moved: neither asleep nor awake
                self.die(f"sleep failed half-way and its weights could not be put back: {message}", 70,
                         between_batches=True)
                return True
        self.state.record(item.command, 0)
        self.post(Ack(command=_KIND[item.command], ok=ok, message=message, host_kept=hostcopy.kept(),
                     ack_id=item.ack_id))
        if item.command == "shutdown":
            self.on_exit(0 if drained else 1)
            return True
        return False

    def _undo_sleep(self) -> bool:
        """After a sleep that raised part-way, everything back on the device as before (the engine keeps the
        worker READY and sends it batches); False where that fails too."""
        try:
            self.pipeline.wake()
            for part in (self.controlnets, self.ip_adapters):
                if part is not None:
                    part.place(asleep=False)
            self.finish.place(asleep=False)
        except Exception:
            log.exception("putting the weights back after a failed sleep failed")
            return False
        return True
