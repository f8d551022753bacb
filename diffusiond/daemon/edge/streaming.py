"""Writing an output's body to an HTTP client: one that lies in shared memory (an npy output, a trajectory's
array), in engine memory, or in a file of the state dir, which is read a piece at a time as it is sent.

The transport does not copy what it is given: the part of a write the kernel did not take yet stays
in its write buffer as a view of the worker's memory. Two rules follow:

- The read stays pinned until the write buffer is empty: only then has every byte left the view.
  Once the handler returns the slot can go back and the worker write another output there.
- Every other exit (a stall, a hang-up, a cancelled handler) aborts the transport. A graceful
  close would flush the buffer later, from memory that may by then hold another job's output.

``--stream-stall-s`` times the absence of progress, as docs/api.md promises ("reads nothing for
this long"), not the writing of a whole chunk: a reader that reads slowly but steadily is never
cut off. Progress is bytes the kernel took off the transport's buffer, checked by a
watchdog a few times per stall period; while the buffer is empty the client is waiting for us (a file's
next piece is read), which is never its stall.

A file is sent the same way, through the same watchdog: each piece is read off the loop
only once the one before it went into the transport, so a reader holds at most a piece or two in the
engine's memory, however large the file and however many read it, and a stalled one is cut off too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterable, Sequence

from aiohttp import web

log = logging.getLogger(__name__)

# Small enough that the transport never holds much more than its high-water mark beyond what the
# kernel takes; large enough that a multi-GiB output is not thousands of writes per second.
PIECE = 1 << 20
POLL_MAX_S = 1.0  # the watchdog looks at least this often (a stall is seen within stall_s + this)
EMPTY_POLL_S = (0.001, 0.05)  # waiting for the last bytes to leave: first and longest sleep


class _Watchdog:
    """Aborts the transport when the kernel takes none of its buffered bytes for ``stall_s``. The
    server cancels a handler whose connection is lost, so the abort may end ``send`` with a
    CancelledError rather than a failed write: either way the read is not complete."""

    def __init__(self, transport: asyncio.Transport, stall_s: float, what: str) -> None:
        self.transport = transport
        self.stall_s = stall_s
        self.what = what
        self.handed = 0  # bytes given to the transport; minus its buffer: bytes the kernel took
        self._task = asyncio.ensure_future(self._watch())

    def sent(self) -> int:
        return self.handed - self.transport.get_write_buffer_size()

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        poll = min(POLL_MAX_S, self.stall_s / 4)
        last, deadline = self.sent(), loop.time() + self.stall_s
        while not self.transport.is_closing():
            await asyncio.sleep(poll)
            now, sent = loop.time(), self.sent()
            # monotonic: ``handed`` grows in the same step as the transport's buffer. Nothing buffered:
            # the client took all it was given and waits for the next piece (read from a file)
            if sent > last or not self.transport.get_write_buffer_size():
                last, deadline = sent, now + self.stall_s
            elif now >= deadline:  # logged here: the abort cancels the handler (handler_cancellation)
                log.warning("client stopped reading %s for %gs; closing", self.what, self.stall_s)
                self.transport.abort()  # wakes a write waiting to drain; the next one raises
                return

    def stop(self) -> None:
        self._task.cancel()


Body = Sequence[bytes | memoryview] | AsyncIterable[bytes]


async def _pieces(body: Body) -> AsyncGenerator[bytes | memoryview, None]:
    """The body in pieces of at most ``PIECE``: views of the parts in memory, or a file's reads as they come."""
    if isinstance(body, AsyncIterable):
        async for chunk in body:
            for off in range(0, len(chunk), PIECE):
                yield chunk[off : off + PIECE]
        return
    for part in body:
        view = memoryview(part)  # a slice of bytes would be a copy; the view keeps them alive while buffered
        for off in range(0, len(view), PIECE):
            yield view[off : off + PIECE]


async def send(request: web.Request, resp: web.StreamResponse, body: Body, stall_s: float, what: str) -> bool:
    """Write ``body`` (parts in memory, or a file's pieces as they are read) as the body of the prepared ``resp``;
    True once every byte left the transport's buffer (the caller may then let go of the views), False if
    the client went or stalled, or a file's read failed (the transport is then aborted: nothing more is sent
    from the views, and the client sees a cut, never a short body passed off as whole). ``what`` names the
    body in the log."""
    transport = request.transport
    if transport is None or transport.is_closing():
        return False  # the client left before the first byte: nothing was handed over
    watchdog = _Watchdog(transport, stall_s, what)
    done = False
    try:
        async with contextlib.aclosing(_pieces(body)) as pieces:  # a file's reader ends here, not at GC
            async for piece in pieces:
                watchdog.handed += len(piece)  # in the same step as the transport takes it (no await between)
                await resp.write(piece)
        await resp.write_eof()
        delay = EMPTY_POLL_S[0]
        while transport.get_write_buffer_size() and not transport.is_closing():
            await asyncio.sleep(delay)
            delay = min(delay * 2, EMPTY_POLL_S[1])
        done = not transport.is_closing() and not transport.get_write_buffer_size()
    except ConnectionError:  # the client left mid-download (ConnectionResetError, aiohttp's "Connection lost")
        pass
    except OSError as exc:  # a file's read failed after the headers went: a cut is the only honest end
        log.warning("sending %s failed after its first bytes: %s; closing the connection", what, exc)
    finally:
        watchdog.stop()
        if not done:  # a stall, a hang-up, or the handler cancelled: drop the buffered views now
            with contextlib.suppress(Exception):
                transport.abort()
    return done
