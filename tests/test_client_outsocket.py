"""The client's side of the output socket when something goes wrong around it: an UNPIN left in the queue while
another call held the mapper, a client closed while a fetch is under way, a zero-copy client after one fetch
failed, and a live update answered with bytes that do not decode. A fake output socket (a thread with a script
per connection) gives the answers, and says what reached it; the real daemon's good path is in test_zerocopy.py.
"""

from __future__ import annotations

import array
import asyncio
import gc
import os
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import numpy as np
import pytest

from diffusiond import AsyncClient, Client, ClientError, DaemonError
from diffusiond.client.zerocopy import OutputMapper, ZeroCopyUnavailable
from diffusiond.ipc.frames import FrameDecoder, FrameEncoder
from diffusiond.ipc.messages import Fetch, Lease, Refused, Unpin
from diffusiond.ipc.tensors import TensorDesc

WAIT_S = 10.0  # how long the fake waits for what the test expects of the client; a pass never waits it out
GARBAGE = b"not a frame at all, just bytes" * 4


class Peer:
    """One accepted connection as the fake daemon sees it: the messages in, the answers out."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.decoder = FrameDecoder()
        self.encoder = FrameEncoder()
        self.pending: list[object] = []

    def next(self, timeout: float = WAIT_S) -> object | None:
        """The next message from the client; None once it hung up (or sent nothing within ``timeout``)."""
        self.conn.settimeout(timeout)
        while not self.pending:
            try:
                data, anc, _flags, _addr = self.conn.recvmsg(1 << 16, socket.CMSG_SPACE(64 * 4))
            except TimeoutError:
                return None
            for _level, _type, payload in anc:  # an update's memfds: not read here
                fds = array.array("i")
                fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
                for fd in fds:
                    os.close(fd)
            if not data:
                return None
            self.pending += [msg for _kind, _seq, _n, msg in self.decoder.feed(data)]
        return self.pending.pop(0)

    def lease(self, lease: int) -> None:
        """A LEASE of 4 KiB of a memfd of its own."""
        fd = os.memfd_create("diffusiond-test-lease")
        os.ftruncate(fd, 4096)
        desc = TensorDesc(dtype="uint8", shape=(4096,), nbytes=4096, slot_id=0, offset=0)
        frame = self.encoder.encode(Lease(lease=lease, tensor=desc, map_bytes=4096), 1)
        self.conn.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
        os.close(fd)

    def refuse(self, fetch: Fetch) -> None:
        self.conn.sendall(self.encoder.encode(Refused(fetch.job_id, fetch.index, 404, "job_not_found",
                                                      f"no job {fetch.job_id}")))


@contextmanager
def output_socket(sock: str, *scripts: Callable[[Peer], None]) -> Iterator[list[BaseException]]:
    """A fake output socket beside ``sock``: the n-th connection is served by the n-th script. Yields the errors
    the scripts raised (their asserts), for the test to check once the client is done."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock + ".out")
    listener.listen(len(scripts))
    failed: list[BaseException] = []

    def run() -> None:
        for script in scripts:
            conn, _ = listener.accept()
            with conn:
                try:
                    script(Peer(conn))
                except BaseException as exc:
                    failed.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield failed
        thread.join(WAIT_S * 2)
        assert not thread.is_alive(), "the fake output socket still waits for the client"
    finally:
        listener.close()


def test_an_unpin_queued_while_a_failing_fetch_held_the_mapper_still_reaches_the_daemon(tmp_path: Path) -> None:
    """Suspicion 1: the last array of a lease dropped while another thread's fetch waited for its answer leaves its
    UNPIN in the queue, for the thread holding the mapper to send. That fetch failed (a bad frame), and the queue
    was never sent again: the connection stayed open for that lease, the daemon kept its slot pinned, for good."""
    sock = str(tmp_path / "d.sock")
    fetching, dropped = threading.Event(), threading.Event()
    heard: list[object] = []

    def daemon(peer: Peer) -> None:
        assert isinstance(peer.next(), Fetch)
        peer.lease(7)
        assert isinstance(peer.next(), Fetch)  # the second fetch: its answer waits until the array is dropped
        fetching.set()
        assert dropped.wait(WAIT_S)
        peer.conn.sendall(GARBAGE)
        heard.append(peer.next())  # an UNPIN, or None: the mapper hung up, which gives the slot back too

    with output_socket(sock, daemon) as failed:
        m = OutputMapper(sock, timeout=WAIT_S)
        a = m.array("j", 0)
        errors: list[BaseException] = []

        def second() -> None:
            try:
                m.array("j", 1)
            except BaseException as exc:
                errors.append(exc)

        t = threading.Thread(target=second)
        t.start()
        assert fetching.wait(WAIT_S)
        del a
        gc.collect()  # the GC's finalizer queues the UNPIN: the other thread holds the mapper
        dropped.set()
        t.join(WAIT_S * 2)
    assert not failed, failed
    assert len(errors) == 1 and isinstance(errors[0], ZeroCopyUnavailable) and "bad frame" in str(errors[0])
    assert heard == [Unpin(7)] or (heard == [None] and not m._sock_open), (
        f"the daemon heard {heard} after the array was dropped: its slot stayed pinned")
    m.close()


async def test_closing_the_client_while_a_fetch_waits_leaves_the_event_loop_running(tmp_path: Path) -> None:
    """Suspicion 2: ``close()`` closed the output mapper in the loop's own thread, and that waits for the mapper's
    lock, which a fetch under way (in a worker thread) holds until the daemon answers: every task of the program
    stood still for up to the mapper's 30 s, here until the fake gives up waiting for the loop."""
    sock = str(tmp_path / "d.sock")
    fetching, answer = threading.Event(), threading.Event()
    told_in_time: list[bool] = []

    def daemon(peer: Peer) -> None:
        fetch = peer.next()
        assert isinstance(fetch, Fetch)
        fetching.set()
        told_in_time.append(answer.wait(WAIT_S))  # set by a callback on the client's loop
        peer.refuse(fetch)
        assert peer.next() is None  # the close

    with output_socket(sock, daemon) as failed:
        c = AsyncClient(sock, zero_copy=True)
        fetch = asyncio.ensure_future(c.array("j", 0))
        assert await asyncio.to_thread(fetching.wait, WAIT_S)
        fetch.cancel()  # as asyncio.wait_for does; its thread still waits for the answer
        with suppress(asyncio.CancelledError):
            await fetch
        closing = asyncio.ensure_future(c.close())
        asyncio.get_running_loop().call_soon(answer.set)  # runs only if close() lets the loop go on
        await closing
    assert not failed, failed
    assert told_in_time == [True], "close() held the event loop until the fetch under way ended"


async def test_a_zero_copy_client_is_not_broken_for_good_by_one_failed_fetch(tmp_path: Path) -> None:
    """Suspicion 3: with ``zero_copy=True`` a fetch whose connection failed (here a bad frame) left the closed
    mapper in the client, and every later fetch, on any job, raised "this OutputMapper is closed; make a new
    one", which a client's user cannot do. The next fetch connects again."""
    sock = str(tmp_path / "d.sock")

    def broken(peer: Peer) -> None:
        assert isinstance(peer.next(), Fetch)
        peer.conn.sendall(GARBAGE)
        assert peer.next() is None  # the client hangs up on it

    def sound(peer: Peer) -> None:
        fetch = peer.next()
        assert isinstance(fetch, Fetch)
        peer.refuse(fetch)
        assert peer.next() is None

    with output_socket(sock, broken, sound) as failed:
        async with AsyncClient(sock, zero_copy=True) as c:
            with pytest.raises(ZeroCopyUnavailable, match="bad frame"):
                await c.array("j", 0)
            with pytest.raises(DaemonError) as refused:  # the daemon's own answer, from a new connection
                await c.array("k", 0)
    assert not failed, failed
    assert refused.value.status == 404 and refused.value.code == "job_not_found" and "no job k" in str(refused.value)


@pytest.mark.parametrize("update", ["lora", "weights"])
def test_an_update_answered_with_bytes_that_do_not_decode_is_a_daemon_error(tmp_path: Path, update: str) -> None:
    """Suspicion 4: the frame decoder's ProtocolError (an IPCError, outside the client's tree) came out of
    ``update_lora``/``update_weights`` as it was: ``except ClientError`` did not catch it."""
    sock = str(tmp_path / "d.sock")

    def daemon(peer: Peer) -> None:
        assert peer.next() is not None  # the update, its memfds closed
        peer.conn.sendall(GARBAGE)

    tensors = {"a.lora_A.weight": np.zeros((2, 2), np.float32)}
    with output_socket(sock, daemon) as failed, Client(sock, timeout=WAIT_S) as c, \
            pytest.raises(ClientError) as info:
        c.update_lora("ink", tensors) if update == "lora" else c.update_weights("tiny", "unet", tensors)
    assert not failed, failed
    assert isinstance(info.value, DaemonError) and info.value.code == "bad_answer", repr(info.value)
    assert "does not decode" in str(info.value) and "bad frame magic" in str(info.value), str(info.value)
