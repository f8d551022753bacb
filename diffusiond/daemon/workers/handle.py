"""The engine's side of one worker process: spawn, handshake, channel, arena mapping, commands.

A ``WorkerHandle`` is the only thing in the engine that knows a worker is a process (the pool and
the engine see it as a ``link.WorkerLink``). It maps the
worker's arena read-only once (from HELLO), maps dedicated output buffers as they arrive, routes
the frames that concern jobs to the engine, and turns every way a worker can end (exit code,
signal, protocol error, FATAL) into one sentence handed to ``on_lost`` exactly once.

Workers are forked from the template (``template.py``: imports done, CUDA never initialised) where
``--preimport`` says so, else started with ``sys.executable -m diffusiond.worker --fd N``: a fresh
interpreter, never a fork of a process that may hold CUDA state. Either way an INIT frame configures
it (no pickle, no command-line encoding of the config).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import time
from collections.abc import Sequence

import msgspec

from diffusiond.daemon.workers.link import Command, FrameCallback, LostCallback, WorkerStartError
from diffusiond.daemon.workers.template import ForkedProcess, Template, describe_exit
from diffusiond.ipc.arena import MappedView, is_sealed
from diffusiond.ipc.channel import Channel, close_all, socketpair
from diffusiond.ipc.errors import ChannelClosed, ProtocolError
from diffusiond.ipc.frames import Frame
from diffusiond.ipc.messages import (
    KIND_OF,
    Ack,
    Cancel,
    Execute,
    Fatal,
    Hello,
    Init,
    Kind,
    OutputReady,
    Ping,
    PreviewReady,
    Ready,
    Release,
    Shutdown,
    WorkerConfig,
)
from diffusiond.ipc.tensors import TensorDesc
from diffusiond.protocol import WorkerState

log = logging.getLogger(__name__)


class WorkerHandle:
    def __init__(
        self,
        config: WorkerConfig,
        *,
        on_frame: FrameCallback,
        on_lost: LostCallback,
        env: dict[str, str] | None = None,
        template: Template | None = None,
    ) -> None:
        self.config = config
        self.env = env or {}
        self.template = template
        self.id = config.worker_id
        self.on_frame = on_frame
        self.on_lost = on_lost
        self.state = WorkerState.STARTING
        self.proc: asyncio.subprocess.Process | ForkedProcess | None = None
        self.channel: Channel | None = None
        self.arena: MappedView | None = None
        self.dedicated: dict[int, MappedView] = {}
        self.held: dict[int, int] = {}  # slot id -> bytes, for outputs the engine has not released
        self.ready: Ready | None = None
        self.fatal: str | None = None
        self.fatal_between_batches = False  # its FATAL said it exits between batches (flights.lost requeues)
        self.lost_reason: str | None = None
        self.started_at = time.monotonic()
        self._ready_fut: asyncio.Future[Ready] | None = None
        # ack_id -> the command's kind and the future its ACK resolves; an entry leaves with its waiter
        self._acks: dict[int, tuple[Kind, asyncio.Future[Ack]]] = {}
        self._last_ack_id = 0
        self.asked_to_stop = False  # stop() was called: a command it then fails is the engine's doing, not a crash
        self._exited: asyncio.Future[int] | None = None
        self._forking: asyncio.Future[ForkedProcess | None] | None = None  # the template's fork, while it runs
        self.last_frame_at = time.monotonic()
        self.loras_loaded: list[str] = []
        self.host_kept = 0  # host copy of its weights it keeps (hostcopy.py), as its last SLEEP/WAKE/RELEASE said

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def name(self) -> str:
        return f"worker {self.id} (pid {self.pid}, {self.config.device})"

    # lifecycle ------------------------------------------------------------------------------
    async def start(self, timeout: float) -> Ready:
        """Spawn, send INIT, wait for HELLO and READY. Raises WorkerStartError with the cause."""
        loop = asyncio.get_running_loop()
        self._exited = loop.create_future()
        if self.asked_to_stop:  # stopped before this ran: a template's fork would wait out its imports for nothing
            await self._never_started(WorkerStartError("stopped"))
            raise WorkerStartError(f"{self.name} was stopped before it started")
        deadline = loop.time() + timeout  # one bound for the template's imports, the fork and the load
        self._ready_fut = loop.create_future()
        # a start that timed out or was cancelled no longer awaits it when _reap fails it: read here, or asyncio
        # logs "Future exception was never retrieved" with a traceback
        self._ready_fut.add_done_callback(lambda f: f.cancelled() or f.exception())
        mine, theirs = socketpair()
        env = {**os.environ, **self.env}
        try:
            if self.template is not None and self.template.serves(self.config.device):
                level = self.env.get("DIFFUSIOND_LOG_LEVEL", "INFO")
                # a stop() cancels it: the template's imports can take minutes, and a worker forked after its stop
                # came back as READY with nothing left to stop it
                self._forking = asyncio.ensure_future(self.template.fork(self.env, level, theirs.fileno(), timeout))
                try:
                    self.proc = await self._forking
                finally:
                    self._forking = None
                if self.proc is not None:
                    log.info("%s forked from the worker template", self.name)
                else:  # a child of a template that broke mid-fork may hold this pair: a new one
                    mine.close()
                    theirs.close()
                    mine, theirs = socketpair()
                    deadline = loop.time() + timeout  # its own, whatever the template took
            if self.proc is None and not self.asked_to_stop:
                self.proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "diffusiond.worker", "--fd", str(theirs.fileno()),
                    pass_fds=(theirs.fileno(),), env=env, stdin=asyncio.subprocess.DEVNULL,
                )
            if self.asked_to_stop:
                raise WorkerStartError(f"{self.name} was stopped while it started")
        except BaseException as exc:  # a cancelled start: the worker, if any was forked, sees EOF and leaves
            mine.close()
            await self._never_started(exc)
            if isinstance(exc, asyncio.CancelledError) and self.asked_to_stop and not _cancelling():
                raise WorkerStartError(f"{self.name} was stopped while it started") from None
            raise
        finally:
            theirs.close()
        self.channel = Channel(mine, name=f"worker {self.id}")
        self.channel.start(self._on_frame, self._on_close)
        self.channel.post(Init(self.config))
        try:
            self.ready = await asyncio.wait_for(asyncio.shield(self._ready_fut), max(0.0, deadline - loop.time()))
        except TimeoutError:
            self.kill()
            spec = self.config.model_spec
            raise WorkerStartError(f"{self.name} did not load {spec!r} within {timeout:.0f}s") from None
        if self.asked_to_stop:  # its READY came while stop() was killing it: it is not coming back
            raise WorkerStartError(f"{self.name} was stopped while it started")
        self.state = WorkerState.READY
        log.info("%s ready: %s on %s in %.0f ms, %.0f ms after its spawn", self.name, self.ready.model_name,
                 self.ready.device, self.ready.load_ms, (time.monotonic() - self.started_at) * 1000)
        return self.ready

    async def _never_started(self, exc: BaseException) -> None:
        """A start that ended before its channel existed: no ``_reap`` will resolve ``_exited``, which a
        stop() waits on, so it is resolved here, once the process (if any was made) is gone."""
        rc = -1
        if self.proc is not None:
            self.kill()
            rc = await self.proc.wait()
        self.state = WorkerState.DEAD
        self.lost_reason = self.lost_reason or (f"{self.name} was stopped while it started" if self.asked_to_stop
                                                else f"{self.name} did not start: {type(exc).__name__}: {exc}")
        if self._exited is not None and not self._exited.done():
            self._exited.set_result(rc)

    def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()

    async def stop(self, timeout: float) -> None:
        """Graceful: SHUTDOWN (the worker drains its copies first), then wait; SIGKILL once ``timeout`` has
        passed since the call, the answer and the exit together (each had its own, so a worker inside a long
        forward took twice the timeout to be killed)."""
        if self.state == WorkerState.DEAD:
            return
        self.state = WorkerState.STOPPING
        self.asked_to_stop = True
        if self._exited is None:  # never started: nothing to wait for
            self.state = WorkerState.DEAD
            return
        if self._forking is not None:
            self._forking.cancel()  # start() sees it and resolves _exited
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        with contextlib.suppress(Exception):
            await self.command(Shutdown(), timeout)
        if self.proc is not None:
            try:
                await asyncio.wait_for(self.proc.wait(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                log.warning("%s did not exit within %.0fs; killing it", self.name, timeout)
                self.kill()
                await self.proc.wait()
        if self.channel is not None:
            self.channel.close()
        await self.wait_lost()

    async def wait_lost(self) -> str:
        """Wait until the worker is gone (its channel closed and the process reaped)."""
        assert self._exited is not None
        await asyncio.shield(self._exited)
        return self.lost_reason or ""

    # commands -------------------------------------------------------------------------------
    def execute(self, batch: Execute, fds: Sequence[int] = ()) -> None:
        if self.channel is None or self.channel.closed:
            raise ChannelClosed(f"{self.name} is not connected ({self._unconnected()})")
        self.channel.post(batch, fds, close_fds=True)

    def cancel(self, request_ids: list[str]) -> None:
        if self.state != WorkerState.DEAD:
            self._post(Cancel(request_ids))

    async def command(self, msg: Command, timeout: float, fds: Sequence[int] = ()) -> Ack:
        """Send a command and wait for its own ACK; ``fds`` go with it and are closed once sent.

        Each command gets an ``ack_id`` its ACK echoes. A command that times out stays queued in the worker
        (an update waits for the batch in progress), so its ACK comes later: with nothing but the kind to go
        by, it answered the next command of that kind, which could then be reported applied before the
        worker read it. Now it finds no waiter and is dropped (``_on_ack``)."""
        kind = KIND_OF[type(msg)]
        self._last_ack_id += 1
        ack_id = self._last_ack_id
        msg = msgspec.structs.replace(msg, ack_id=ack_id)
        fut: asyncio.Future[Ack] = asyncio.get_running_loop().create_future()
        self._acks[ack_id] = (kind, fut)
        try:
            if fds:
                if self.channel is None or self.channel.closed:
                    close_all(fds)
                    raise ChannelClosed(f"{self.name} is not connected ({self._unconnected()})")
                self.channel.post(msg, fds, close_fds=True)
            else:
                self._post(msg)
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._acks.pop(ack_id, None)

    def _unconnected(self) -> str:
        if self.lost_reason:
            return self.lost_reason
        return "not started" if self.channel is None else "its channel closed"  # it had started

    def _post(self, msg: Execute | Cancel | Command) -> None:
        if self.channel is None or self.channel.closed:
            raise ChannelClosed(f"{self.name} is not connected ({self._unconnected()})")
        self.channel.post(msg)

    # outputs --------------------------------------------------------------------------------
    def buffer(self, desc: TensorDesc) -> memoryview:
        """The read-only mapping an output lives in (pass with ``desc`` to ``as_numpy``)."""
        if desc.dedicated:
            return self.dedicated[desc.slot_id].view
        if self.arena is None:
            raise ChannelClosed(f"{self.name} has no arena mapped")
        return self.arena.view

    def share(self, desc: TensorDesc) -> tuple[int, int] | None:
        """The fd an output lives in and its size, to hand to a local client; None where the
        memory is not sealed against writes (then only its bytes may leave, over HTTP)."""
        view = self.dedicated.get(desc.slot_id) if desc.dedicated else self.arena
        if view is None or view.fd is None:
            return None
        return view.fd, view.nbytes

    def return_slot(self, desc: TensorDesc) -> None:
        """The engine is done with an output: unmap a dedicated buffer, give the slot back."""
        self.held.pop(desc.slot_id, None)
        if desc.dedicated:
            view = self.dedicated.pop(desc.slot_id, None)
            if view is not None and not view.close():
                log.warning("dedicated output %d still has readers; unmapped when they finish", desc.slot_id)
        if self.state != WorkerState.DEAD and self.channel is not None and not self.channel.closed:
            self.channel.post(Release([desc.slot_id]))
        elif self.state == WorkerState.DEAD:
            self._unmap_when_unused()

    def _unmap_when_unused(self) -> None:
        """A dead worker's outputs stay readable (the mapping keeps the memory) until released; one in a
        dedicated memfd has its own mapping and keeps no arena mapped."""
        in_arena = any(slot_id not in self.dedicated for slot_id in self.held)
        if self.arena is not None and not in_arena and self.arena.close():
            self.arena = None

    @property
    def arena_capacity(self) -> int:
        return self.arena.nbytes if self.arena else 0

    @property
    def held_bytes(self) -> int:
        """Shared memory outputs hold: arena slots and dedicated memfds (``/health``'s ``arena_bytes_in_use``)."""
        return sum(self.held.values())

    @property
    def arena_held_bytes(self) -> int:
        """Of ``held_bytes``, the arena's slots: all that spilling can give back to a worker waiting for
        room, a dedicated memfd holding none of it."""
        return sum(n for slot_id, n in self.held.items() if slot_id not in self.dedicated)

    # channel callbacks ----------------------------------------------------------------------
    def ping(self) -> None:
        live = self.state in (WorkerState.READY, WorkerState.SLEEPING)
        if live and self.channel is not None and not self.channel.closed:
            self.channel.post(Ping())

    def answering(self, within: float) -> bool:
        return time.monotonic() - self.last_frame_at <= within

    def _on_frame(self, frame: Frame) -> None:
        msg = frame.msg
        self.last_frame_at = time.monotonic()
        out = msg if isinstance(msg, OutputReady) else None
        regions = _regions(out) if out is not None else []
        if out is not None and any(d.dedicated for d in regions):
            mine = [d for d in regions if d.dedicated]  # the output's fd first, then the trajectory's
            if len(frame.fds) != len(mine):
                close_all(frame.fds)  # the frame is refused, so no one else will close them
                self._protocol_error(f"output {out.request_id} with {len(mine)} dedicated buffers arrived with "
                                     f"{len(frame.fds)} fds")
                return
            for i, (d, fd) in enumerate(zip(mine, frame.fds, strict=True)):
                try:
                    self.dedicated[d.slot_id] = MappedView(fd, d.nbytes, close_fd=not is_sealed(fd))
                except BaseException:  # MappedView closed its own fd; the ones after it are still ours
                    close_all(frame.fds[i + 1 :])
                    raise
        elif frame.fds:
            close_all(frame.fds[1 if isinstance(msg, Hello) else 0 :])
        if isinstance(msg, Hello):
            if not frame.fds:
                self._protocol_error("HELLO arrived without the arena fd")
                return
            self.arena = MappedView(frame.fds[0], msg.arena_bytes, close_fd=not is_sealed(frame.fds[0]))
        elif isinstance(msg, Ready):
            if self._ready_fut and not self._ready_fut.done():
                self._ready_fut.set_result(msg)
        elif isinstance(msg, Ack):
            if not self._on_ack(msg):
                return
            if msg.command == Kind.PING:
                self.loras_loaded = msg.loras_loaded
            if msg.command in (Kind.SLEEP, Kind.WAKE, Kind.RELEASE):
                self.host_kept = msg.host_kept
            if msg.command == Kind.SLEEP and msg.ok:
                self.state = WorkerState.SLEEPING
            elif msg.command == Kind.WAKE and msg.ok:
                self.state = WorkerState.READY
        elif isinstance(msg, Fatal):
            self.fatal = msg.message
            self.fatal_between_batches = msg.between_batches
            log.error("%s: %s", self.name, msg.message)
            if self._ready_fut and not self._ready_fut.done():
                self._ready_fut.set_exception(WorkerStartError(msg.message))
        else:
            for d in regions or ([msg.tensor] if isinstance(msg, PreviewReady) else []):
                self.held[d.slot_id] = d.nbytes
            self.on_frame(self, frame)

    def _on_ack(self, msg: Ack) -> bool:
        """Hand an ACK to the command it answers; False where it answers none this worker was sent (a
        protocol error). One whose command stopped waiting (timed out) is logged and dropped; what it
        says of the worker (asleep, awake, its host copy) is still taken, being true."""
        if not msg.ack_id:  # the heartbeat's PING
            return True
        if msg.ack_id > self._last_ack_id:
            self._protocol_error(f"ACK {msg.ack_id} answers no command sent (the last sent was {self._last_ack_id})")
            return False
        waiting = self._acks.pop(msg.ack_id, None)
        if waiting is None:
            log.warning("%s answered %s (command %d) after its command stopped waiting; dropped: %s", self.name,
                        _kind_name(msg.command), msg.ack_id,
                        "ok" if msg.ok else f"refused: {msg.message}" if msg.message else "not ok")
            return True
        kind, fut = waiting
        if kind != msg.command:
            self._protocol_error(f"ACK {msg.ack_id} says it answers {_kind_name(msg.command)}; "
                                 f"command {msg.ack_id} was {kind.name}")
            return False
        if not fut.done():
            fut.set_result(msg)
        return True

    def _protocol_error(self, text: str) -> None:
        assert self.channel is not None
        self.channel.close(ProtocolError(text))

    def _on_close(self, reason: BaseException | None) -> None:
        # no batch or command for it from now on, though reaping its process takes a while (left
        # READY, it took every batch dispatch sent, each failing and requeued, with the loop never yielding)
        live = self.state in (WorkerState.READY, WorkerState.SLEEPING)
        if live:
            self.state = WorkerState.STOPPING
        asyncio.ensure_future(self._reap(reason, live))  # noqa: RUF006 - _exited holds the outcome

    async def _reap(self, reason: BaseException | None, live: bool) -> None:
        assert self.proc is not None and self._exited is not None
        if isinstance(reason, ProtocolError):
            self.kill()  # nothing it sends can be trusted any more
        try:
            rc = await asyncio.wait_for(self.proc.wait(), 10)
        except TimeoutError:
            self.kill()
            rc = await self.proc.wait()
        self.state = WorkerState.DEAD
        parts = [f"{self.name} {getattr(self.proc, 'exit_note', '') or describe_exit(rc)}"]
        if isinstance(reason, ProtocolError):
            parts.append(f"after a protocol error on its channel: {reason}")
        if self.fatal:
            parts.append(f"({self.fatal})")
        self.lost_reason = " ".join(parts)
        for _, fut in self._acks.values():
            if not fut.done():
                fut.set_exception(ChannelClosed(self.lost_reason))
        if self._ready_fut and not self._ready_fut.done():
            self._ready_fut.set_exception(WorkerStartError(self.lost_reason))
        if not self._exited.done():
            self._exited.set_result(rc)
        if live:  # a crash seen at the close, before any stop(); one that never became ready: start()
            self.on_lost(self, self.lost_reason)
        for slot_id in [s for s in self.dedicated if s not in self.held]:
            self.dedicated.pop(slot_id).close()
        self._unmap_when_unused()


def _cancelling() -> bool:
    """The start itself is being cancelled (not only the fork a stop() cancelled): the cancel must go on."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _kind_name(kind: int) -> str:
    try:
        return Kind(kind).name
    except ValueError:
        return f"kind {kind}"


def _regions(msg: OutputReady) -> list[TensorDesc]:
    """The memory an output frame hands over: its tensor's, and its trajectory's region."""
    return [msg.tensor] if msg.trajectory is None else [msg.tensor, msg.trajectory.region]
