"""An async, framed, sequenced channel over a non-blocking AF_UNIX stream socket.

asyncio's stream API cannot pass file descriptors, so the channel drives the socket itself with
the loop's reader and writer callbacks and ``sendmsg``/``recvmsg``. The socket is the only buffer
that matters: when the peer stops reading, ``drain()`` waits instead of dropping anything. There
is no lossy path.

One writer: ``post`` may only be called on the loop's thread (it raises otherwise). Threads hand
frames to the loop with ``post_threadsafe`` (``loop.call_soon_threadsafe``), so frames from many
threads are serialised by the loop and can never interleave on the wire.

``encoder`` turns each message into the bytes that go on the wire. The worker's test-only fault
injector swaps in a subclass that tampers with one frame; an encoder that returns no bytes drops
the frame (its sequence number stays spent, so the peer sees the gap).
"""

from __future__ import annotations

import array
import asyncio
import collections
import contextlib
import logging
import os
import socket
import threading
from collections.abc import Callable, Sequence

import msgspec

from diffusiond.ipc.errors import ChannelClosed, ProtocolError
from diffusiond.ipc.frames import DEFAULT_MAX_BODY, MAX_FDS, Frame, FrameDecoder, FrameEncoder

log = logging.getLogger(__name__)

_RECV_BYTES = 256 << 10
_ANC_SPACE = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)
HIGH_WATER = 1 << 20  # bytes queued locally before drain() waits

FrameHandler = Callable[[Frame], None]
"""Owns the frame's fds from the call on, also when it raises: only the handler knows which it has handed on
(a mapping, a queue), so the channel closing them after a failure could close a number already reused. The
channel closes only the fds no handler was given: those of a frame that failed its checks or never came whole,
and those of frames behind a close."""
CloseHandler = Callable[[BaseException | None], None]


class Channel:
    def __init__(self, sock: socket.socket, *, name: str = "channel", max_body: int = DEFAULT_MAX_BODY) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.name = name
        self.encoder = FrameEncoder(max_body)
        self._decoder = FrameDecoder(max_body)
        self._out: collections.deque[tuple[memoryview, list[int], list[int]]] = collections.deque()
        self._out_bytes = 0
        self._in_fds: collections.deque[int] = collections.deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: int | None = None
        self._on_frame: FrameHandler | None = None
        self._on_close: CloseHandler | None = None
        self._writing = False
        self._drained = asyncio.Event()
        self._drained.set()
        self.closed = False
        self.close_reason: BaseException | None = None

    # lifecycle ------------------------------------------------------------------------------
    def start(self, on_frame: FrameHandler, on_close: CloseHandler) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.get_ident()
        self._on_frame = on_frame
        self._on_close = on_close
        self._loop.add_reader(self.sock.fileno(), self._on_readable)

    def close(self, reason: BaseException | None = None) -> None:
        """Close once; ``on_close`` gets the reason (None for a clean local close)."""
        if self.closed:
            return
        self.closed = True
        self.close_reason = reason
        if self._loop is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self.sock.fileno())
            if self._writing:
                with contextlib.suppress(Exception):
                    self._loop.remove_writer(self.sock.fileno())
        for _, _, owned in self._out:
            close_all(owned)
        self._out.clear()
        close_all(list(self._in_fds))
        self._in_fds.clear()
        with contextlib.suppress(OSError):
            self.sock.close()
        self._drained.set()
        if self._on_close is not None:
            self._on_close(reason)

    # sending --------------------------------------------------------------------------------
    def post(self, msg: msgspec.Struct, fds: Sequence[int] = (), *, close_fds: bool = False) -> None:
        """Queue one frame and write as much as the socket takes now.

        ``fds`` travel with the frame; with ``close_fds`` the channel closes them once sent (or
        when the channel closes), which is how a dedicated memfd changes hands.
        """
        if self._thread is not None and threading.get_ident() != self._thread:
            raise RuntimeError(
                f"{self.name}: post() called off the loop thread; use post_threadsafe() "
                "(the loop is the channel's only writer)"
            )
        if self.closed:
            if close_fds:
                close_all(list(fds))
            raise ChannelClosed(f"{self.name} is closed: {self.close_reason}")
        data = self.encoder.encode(msg, len(fds))  # raises FrameTooLarge before anything is queued
        self._out.append((memoryview(data), list(fds), list(fds) if close_fds else []))
        self._out_bytes += len(data)
        if not self._writing:
            self._flush()

    def post_threadsafe(self, msg: msgspec.Struct, fds: Sequence[int] = (), *, close_fds: bool = False) -> None:
        assert self._loop is not None, "channel not started"
        self._loop.call_soon_threadsafe(self._post_or_log, msg, list(fds), close_fds)

    def _post_or_log(self, msg: msgspec.Struct, fds: list[int], close_fds: bool) -> None:
        try:
            self.post(msg, fds, close_fds=close_fds)
        except ChannelClosed:
            log.debug("%s: dropped %s after close", self.name, type(msg).__name__)

    async def drain(self, below: int = HIGH_WATER) -> None:
        """Wait until the local queue is under the high-water mark (socket back-pressure); ``below=0``: until all
        of it is sent (a process about to exit: what is still queued then is lost)."""
        while self._out_bytes > below and not self.closed:
            self._drained.clear()
            await self._drained.wait()
        if self.closed and self.close_reason is not None:
            raise ChannelClosed(f"{self.name} is closed: {self.close_reason}")

    @property
    def pending_bytes(self) -> int:
        return self._out_bytes

    def _flush(self) -> None:
        try:
            while self._out:
                buf, fds, owned = self._out[0]
                if fds:
                    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
                    n = self.sock.sendmsg([buf], anc)
                    self._out[0] = (buf, [], owned)  # fds go with the first byte only
                else:
                    n = self.sock.send(buf)
                self._out_bytes -= n
                if n < len(buf):
                    self._out[0] = (buf[n:], [], owned)
                    raise BlockingIOError
                self._out.popleft()
                close_all(owned)
        except (BlockingIOError, InterruptedError):
            if not self._writing and self._loop is not None:
                self._loop.add_writer(self.sock.fileno(), self._flush)
                self._writing = True
            return
        except OSError as exc:
            self.close(ChannelClosed(f"{self.name}: send failed: {exc}"))
            return
        if self._writing and self._loop is not None:
            self._loop.remove_writer(self.sock.fileno())
            self._writing = False
        if self._out_bytes <= HIGH_WATER:
            self._drained.set()

    # receiving ------------------------------------------------------------------------------
    def _on_readable(self) -> None:
        try:
            data, fds = recv_with_fds(self.sock)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self.close(ChannelClosed(f"{self.name}: receive failed: {exc}"))
            return
        self._in_fds.extend(fds)
        if not data:
            self.close(ChannelClosed(f"{self.name}: peer closed the connection"))
            return
        try:
            frames = self._decoder.feed(data)
            for kind, seq, nfds, msg in frames:
                if nfds > len(self._in_fds):
                    raise ProtocolError(f"{kind.name} frame {seq} announces {nfds} fds, {len(self._in_fds)} arrived")
                fds = [self._in_fds.popleft() for _ in range(nfds)]
                assert self._on_frame is not None
                try:
                    self._on_frame(Frame(kind, seq, msg, fds))
                except Exception:  # a bug in one frame's handling: the frames read with it are not lost
                    log.exception("%s: handling %s frame %d failed", self.name, kind.name, seq)
                if self.closed:
                    return
            if self._decoder.broken is not None:  # after the frames that came before it
                raise self._decoder.broken
        except ProtocolError as exc:
            log.error("%s: %s", self.name, exc)
            self.close(exc)


_CLOEXEC = getattr(socket, "MSG_CMSG_CLOEXEC", 0)


def recv_with_fds(sock: socket.socket) -> tuple[bytes, list[int]]:
    """One ``recvmsg``: the bytes, and the fds that came with them (SCM_RIGHTS), in order.
    Also the blocking read of a peer that is not a ``Channel`` (``diffusiond.client.zerocopy``)."""
    # close-on-exec as they arrive: a program that runs another between receiving an output's memfd and mapping
    # it would hand it on
    data, anc, _flags, _addr = sock.recvmsg(_RECV_BYTES, _ANC_SPACE, _CLOEXEC)
    fds: list[int] = []
    for level, type_, payload in anc:
        if level == socket.SOL_SOCKET and type_ == socket.SCM_RIGHTS:
            received = array.array("i")
            received.frombytes(payload[: len(payload) - len(payload) % received.itemsize])
            fds.extend(received)
    return data, fds


def close_all(fds: Sequence[int]) -> None:
    """Close each of ``fds``, whatever the others do: one already gone must not keep the rest open."""
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def socketpair() -> tuple[socket.socket, socket.socket]:
    """A connected AF_UNIX stream pair. Both ends stay close-on-exec: hand one to exactly one
    child with ``pass_fds``. An inheritable end would leak into every other child spawned while
    it is open, and a dead worker's channel would then never see EOF."""
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
