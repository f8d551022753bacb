"""The output socket: outputs handed to programs on this machine as file descriptors, not bytes.

An output already lies in shared memory (a worker's memfd arena, or a dedicated memfd). A
program of the daemon's own user can map that memory and read the output where it is: no copy
in the engine, none over a socket, none into the reader. This is the second hop of the output
path, after the worker -> engine hop that ``ipc`` already makes without copies.

Why a second Unix socket beside the HTTP one: an fd travels only with ``sendmsg`` (SCM_RIGHTS)
on a Unix socket that we read and write ourselves, and aiohttp's transports (uvloop's in
particular) give no access to that. The socket speaks the frames of ``ipc`` (numbered msgspec
messages, fds attached): FETCH(job, k) -> LEASE(fd) or REFUSED(the HTTP status and error the
HTTP API would have given), then UNPIN(lease) when the program dropped its arrays. FETCH with part
"trajectory" leases the memory of output k's trajectory, its arrays named in the LEASE. The same
socket takes live LoRA updates the other way: UPDATE_LORA with the memfd of the tensors ->
UPDATED(version) or UPDATE_REFUSED (``daemon/core/weights.py``).

What keeps it safe:
- Only processes of the daemon's own user may connect (socket mode 0600, and SO_PEERCRED checked
  again): they could read the daemon's memory through /proc anyway, so an fd gives them nothing
  new. Other ``--allow-uid`` users use HTTP.
- The memory is sealed against writes (``F_SEAL_FUTURE_WRITE``, set by the worker right after it
  mapped it): the fd maps read-only, even reopened through /proc. A daemon on a kernel without
  the seal answers REFUSED ``not_shared`` and the client falls back to HTTP.
- A lease pins its slot; the slot goes back at UNPIN or when the connection closes, which the
  kernel does for a program that dies, so a killed client never holds an arena.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING

from diffusiond.daemon.core.jobs import Item
from diffusiond.daemon.edge.access import socket_peer_uid  # the HTTP edge's rules, here too
from diffusiond.daemon.edge.status import status_of, unexpected
from diffusiond.daemon.errors import EngineError, JobNotFound, NotShared
from diffusiond.ipc.channel import Channel
from diffusiond.ipc.errors import ChannelClosed
from diffusiond.ipc.frames import Frame
from diffusiond.ipc.messages import Fetch, Lease, Refused, Unpin, Updated, UpdateLora, UpdateRefused, UpdateWeights
from diffusiond.ipc.tensors import TensorDesc
from diffusiond.pipelines.errors import PipelineError
from diffusiond.protocol import ErrorCode

if TYPE_CHECKING:
    from diffusiond.daemon.core.engine import Engine

log = logging.getLogger(__name__)


class OutputSocket:
    def __init__(self, engine: Engine, path: str) -> None:
        self.engine = engine
        self.path = path
        self._server: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._connections: set[_Connection] = set()

    async def start(self) -> None:
        p = Path(self.path)
        with contextlib.suppress(FileNotFoundError):
            if p.is_socket():
                p.unlink()  # our own from an earlier run: the HTTP socket's bind already proved none serves
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            sock.bind(self.path)
        except OSError:
            sock.close()
            raise
        finally:
            os.umask(old)
        sock.listen(64)
        sock.setblocking(False)
        self._server = sock
        self._accepting = asyncio.ensure_future(self._accept())

    async def close(self) -> None:
        if self._accepting is not None:
            self._accepting.cancel()
        for conn in list(self._connections):
            conn.channel.close()
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    async def _accept(self) -> None:
        assert self._server is not None
        loop = asyncio.get_running_loop()
        while True:
            try:
                client, _ = await loop.sock_accept(self._server)
            except OSError as exc:  # out of fds, say: keep serving the connections we have
                log.warning("output socket: accept failed: %s", exc)
                await asyncio.sleep(0.5)
                continue
            uid = socket_peer_uid(client)
            if uid != os.getuid():
                log.warning("output socket: refused uid %s (only the daemon's own user maps outputs)", uid)
                client.close()
                continue
            conn = _Connection(self, Channel(client, name="output socket client"))
            self._connections.add(conn)
            conn.channel.start(conn.on_frame, conn.on_close)


class _Connection:
    """One client: its leases live exactly as long as the connection, or until UNPIN."""

    def __init__(self, server: OutputSocket, channel: Channel) -> None:
        self.server = server
        self.channel = channel
        self.leases: dict[int, tuple[Item, bool]] = {}  # lease -> its item, and whether of its trajectory
        self._next = 0
        self._updates: set[asyncio.Task[None]] = set()  # and the state-dir look-up, while one runs
        self._waiting: collections.deque[Fetch] = collections.deque()  # FETCHes not answered yet, in order

    async def _update(self, msg: UpdateLora | UpdateWeights, fds: list[int]) -> None:
        """Runs to its end even if the client hangs up: the workers finish the update either way
        (each has its own copy of the fd), and only the answer is lost."""
        engine = self.server.engine
        name = msg.name if isinstance(msg, UpdateLora) else f"{msg.model}/{msg.component}"
        timeout = engine.config.worker_start_timeout_s
        try:
            if isinstance(msg, UpdateLora):
                version = await engine.live_loras.update(msg, fds, engine.models(), timeout)
            else:
                version = await engine.live_components.update(msg, fds, engine.pool.model, timeout)
        except EngineError as err:
            answer: Updated | UpdateRefused = UpdateRefused(name, status_of(err), str(err.code), err.message,
                                                            err.field)
        except PipelineError as exc:  # a model's spec or files the update's checks could not read
            answer = UpdateRefused(name, 400, str(ErrorCode.INVALID_REQUEST), f"{name}: {exc}")
        except Exception:  # a trainer waiting with no timeout must get an answer whatever failed
            bug = unexpected(f"the update of {name}")
            answer = UpdateRefused(name, status_of(bug), str(bug.code), bug.message)
        else:
            answer = Updated(name, version)
        with contextlib.suppress(ChannelClosed):  # the client went away: the update stands
            self.channel.post(answer)

    def on_frame(self, frame: Frame) -> None:
        msg = frame.msg
        if isinstance(msg, UpdateLora | UpdateWeights):  # the frames that bring an fd, owned by the update
            task = asyncio.ensure_future(self._update(msg, list(frame.fds)))
            self._updates.add(task)
            task.add_done_callback(self._updates.discard)
            return
        for fd in frame.fds:  # a client has no business sending fds
            os.close(fd)
        if isinstance(msg, Fetch):
            self._waiting.append(msg)
            if len(self._waiting) == 1:  # else it waits behind a look-up in the state dir, which answers it
                self._answer_waiting()
        elif isinstance(msg, Unpin):
            lease = self.leases.pop(msg.lease, None)
            if lease is not None:
                self._end(*lease)
        else:
            self.channel.close(ValueError(f"unexpected {type(msg).__name__} on the output socket"))

    def _fetch(self, msg: Fetch) -> bool:
        """Answer a FETCH of a job in memory; False: the job is not in memory but the state dir may hold it,
        which only ``_look_up`` (awaiting the store) can tell."""
        engine = self.server.engine
        arrays: dict[str, TensorDesc] = {}
        try:
            if msg.part != "output":  # a trajectory or a sound track: the output's side region
                item, desc, arrays, fd, size = engine.lease_trajectory(msg.job_id, msg.index, msg.part == "audio")
            else:
                item, desc, fd, size = engine.lease_output(msg.job_id, msg.index)
        except JobNotFound as missing:
            if engine.store.persistent:
                return False
            self._refuse(msg, missing)
            return True
        except EngineError as refused:
            self._refuse(msg, refused)
            return True
        self._next += 1
        self.leases[self._next] = (item, msg.part != "output")
        self.channel.post(Lease(self._next, desc, size, arrays), [fd])
        return True

    def _answer_waiting(self) -> None:
        """Answer the waiting FETCHes in order (a LEASE does not say which FETCH it answers), until one needs
        the state dir: that one's look-up answers it and goes on from there."""
        while self._waiting and not self.channel.closed:
            if not self._fetch(self._waiting[0]):
                task = asyncio.ensure_future(self._look_up(self._waiting[0]))
                self._updates.add(task)
                task.add_done_callback(self._updates.discard)
                return
            self._waiting.popleft()
        self._waiting.clear()  # the client hung up: nobody to answer

    async def _look_up(self, msg: Fetch) -> None:
        """Answer a FETCH for a job that is not in memory. HTTP still serves such a job's outputs from the state
        dir (past ``--retention-s``, or after a restart), so the answer is what lets the client fall back to it:
        ``not_shared`` when the job is there, and the 404 HTTP would give when it is not."""
        try:
            await self.server.engine.history.find(msg.job_id)
        except EngineError as err:
            self._refuse(msg, err)
        except Exception:  # an unreadable state dir, say: still an answer, or the client waits for ever
            self._refuse(msg, unexpected(f"the look-up of job {msg.job_id!r} for the output socket"))
        else:
            self._refuse(msg, NotShared(f"job {msg.job_id} is no longer in memory, so its {msg.part} is not in "
                                        "shared memory; it is served from the state dir over HTTP (GET its URL)"))
        self._waiting.popleft()
        self._answer_waiting()

    def _refuse(self, msg: Fetch, err: EngineError) -> None:
        with contextlib.suppress(ChannelClosed):  # the client went away meanwhile
            self.channel.post(Refused(msg.job_id, msg.index, status_of(err), str(err.code), err.message))

    def _end(self, item: Item, trajectory: bool) -> None:
        if trajectory:
            self.server.engine.end_trajectory_lease(item)
        else:
            self.server.engine.end_lease(item)

    def on_close(self, reason: BaseException | None) -> None:
        if reason is not None:
            log.info("output socket client went away: %s", reason)
        for lease in self.leases.values():
            self._end(*lease)
        self.leases.clear()
        self.server._connections.discard(self)
