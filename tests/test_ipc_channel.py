"""The channel: a real socketpair, real fd passing between processes, one writer, no loss."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest

from conftest import ROOT, memfd_maps, shm_entries
from diffusiond.ipc import messages as m
from diffusiond.ipc.arena import Arena, MappedView
from diffusiond.ipc.channel import Channel, socketpair
from diffusiond.ipc.errors import ChannelClosed, FrameTooLarge, ProtocolError
from diffusiond.ipc.frames import Frame, FrameEncoder
from diffusiond.ipc.tensors import as_numpy, describe, write_tensor


class Inbox:
    """Collects frames from a channel; ``wait_for(n)`` returns once n have arrived."""

    def __init__(self, ch: Channel) -> None:
        self.frames: list[Frame] = []
        self.closed: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()
        self._changed = asyncio.Event()
        ch.start(self._on_frame, self._on_close)

    def _on_frame(self, frame: Frame) -> None:
        self.frames.append(frame)
        self._changed.set()

    def _on_close(self, reason: BaseException | None) -> None:
        if not self.closed.done():
            self.closed.set_result(reason)
        self._changed.set()

    async def wait_for(self, n: int) -> list[Frame]:
        while len(self.frames) < n and not self.closed.done():
            self._changed.clear()
            await asyncio.wait_for(self._changed.wait(), 30)
        return self.frames


async def pair() -> tuple[Channel, Channel]:
    a, b = socketpair()
    return Channel(a, name="a"), Channel(b, name="b")


async def test_channel_round_trip_and_sequence() -> None:
    a, b = await pair()
    Inbox(a)
    inbox = Inbox(b)
    for i in range(100):
        a.post(m.Progress(batch_id=1, step=i, total=100))
    frames = await inbox.wait_for(100)
    assert [f.seq for f in frames] == list(range(100))
    assert [f.msg.step for f in frames] == list(range(100))  # type: ignore[attr-defined]


async def test_channel_oversize_frame_raises_at_sender_and_stream_stays_usable() -> None:
    a, b = socketpair()
    ca, cb = Channel(a, name="a", max_body=512), Channel(b, name="b")
    Inbox(ca)
    inbox = Inbox(cb)
    with pytest.raises(FrameTooLarge):
        ca.post(m.Fatal(message="x" * 4096))
    ca.post(m.Fatal(message="small"))
    frames = await inbox.wait_for(1)
    assert frames[0].seq == 0 and frames[0].msg == m.Fatal(message="small")


async def test_channel_post_off_loop_thread_is_refused() -> None:
    a, _ = await pair()
    Inbox(a)
    errors: list[BaseException] = []

    def poster() -> None:
        try:
            a.post(m.Sleep())
        except RuntimeError as exc:
            errors.append(exc)

    t = threading.Thread(target=poster)
    t.start()
    t.join()
    assert errors and "post_threadsafe" in str(errors[0])


async def test_channel_concurrent_posters_never_interleave_or_lose() -> None:
    """Many threads post at once through the single writer."""
    a, b = await pair()
    Inbox(a)
    inbox = Inbox(b)
    threads, per_thread = 8, 400

    def poster(t: int) -> None:
        for i in range(per_thread):
            a.post_threadsafe(m.RequestEnded(f"t{t}-{i}", t, "failed", "x" * (i % 50), "computing"))

    workers = [threading.Thread(target=poster, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    await asyncio.to_thread(lambda: [w.join() for w in workers])
    frames = await inbox.wait_for(threads * per_thread)
    assert [f.seq for f in frames] == list(range(threads * per_thread))
    for t in range(threads):
        mine = [f.msg.request_id for f in frames if f.msg.batch_id == t]  # type: ignore[attr-defined]
        assert mine == [f"t{t}-{i}" for i in range(per_thread)]


async def test_channel_outputs_of_32_requests_of_900kb_all_delivered() -> None:
    """Seed 001 (aggregate size): 32 x ~900 KB outputs; frames stay tiny, every byte arrives."""
    torch = pytest.importorskip("torch")
    a, b = await pair()
    arena = Arena(64 << 20)
    peer_view = MappedView(os.dup(arena.fd), arena.capacity)
    Inbox(a)
    inbox = Inbox(b)
    batch = torch.randint(0, 256, (32, 300, 750, 4), dtype=torch.uint8)  # 32 x 900 KB
    for i in range(32):
        out = batch[i]
        slot = arena.allocate(out.numel())
        write_tensor(arena.buffer(slot), out)
        a.post(m.OutputReady(f"r{i}", 0, describe(out, slot.id, slot.offset)))
    frames = await inbox.wait_for(32)
    for i, f in enumerate(frames):
        arr = as_numpy(peer_view.view, f.msg.tensor)  # type: ignore[attr-defined]
        assert arr.nbytes == 900_000
        assert np.array_equal(arr, batch[i].numpy())
    # frames carry descriptors only: the whole batch of announcements is a few KB, not 28 MB
    assert sum(len(FrameEncoder().encode(f.msg)) for f in frames) < 32 * 256
    del arr
    assert peer_view.close()
    arena.close()


async def test_channel_frame_sent_before_reader_started_is_delivered() -> None:
    """An output that arrives before anyone waits is kept."""
    a, b = await pair()
    Inbox(a)
    a.post(m.OutputReady("early", 0, describe_fake()))
    await a.drain()
    await asyncio.sleep(0)  # the bytes sit in the socket; nobody is reading yet
    inbox = Inbox(b)
    frames = await inbox.wait_for(1)
    assert frames[0].msg.request_id == "early"  # type: ignore[attr-defined]


def describe_fake():  # type: ignore[no-untyped-def]
    from diffusiond.ipc.tensors import TensorDesc

    return TensorDesc(dtype="uint8", shape=(2,), nbytes=2, slot_id=1)


async def test_channel_peer_hangup_closes_with_reason() -> None:
    a, b = await pair()
    inbox = Inbox(a)
    b.sock.close()
    reason = await asyncio.wait_for(inbox.closed, 10)
    assert isinstance(reason, ChannelClosed) and "peer closed" in str(reason)


async def test_channel_protocol_error_closes_channel() -> None:
    a, b = await pair()
    inbox = Inbox(b)
    a.sock.sendall(b"GARBAGE-NOT-A-FRAME-HEADER!!")
    reason = await asyncio.wait_for(inbox.closed, 10)
    assert isinstance(reason, ProtocolError) and "magic" in str(reason)


async def test_channel_back_pressure_waits_instead_of_dropping() -> None:
    """With a peer that does not read, drain() blocks; once it reads, everything arrives."""
    a, b = await pair()
    Inbox(a)
    big = "y" * 60_000
    for i in range(200):  # ~12 MB queued against a socket buffer of a few hundred KB
        a.post(m.Fatal(message=f"{i}:{big}"))
    drain = asyncio.ensure_future(a.drain())
    await asyncio.sleep(0.05)
    assert not drain.done() and a.pending_bytes > 0
    inbox = Inbox(b)
    frames = await inbox.wait_for(200)
    await asyncio.wait_for(drain, 30)
    assert [int(f.msg.message.split(":")[0]) for f in frames] == list(range(200))  # type: ignore[attr-defined]


def _spawn_peer(mode: str, nbytes: int = 1 << 20) -> tuple[socket.socket, subprocess.Popen[bytes]]:
    mine, theirs = socketpair()
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "ipc_peer.py"), str(theirs.fileno()), str(nbytes), mode],
        pass_fds=[theirs.fileno()],
        cwd=ROOT,
    )
    theirs.close()
    return mine, proc


async def test_channel_fds_pass_between_two_real_processes() -> None:
    sock, proc = _spawn_peer("send")
    ch = Channel(sock, name="engine")
    inbox = Inbox(ch)
    hello, out = await inbox.wait_for(2)
    assert isinstance(hello.msg, m.Hello) and len(hello.fds) == 1
    view = MappedView(hello.fds[0], hello.msg.arena_bytes)
    arr = as_numpy(view.view, out.msg.tensor)  # type: ignore[attr-defined]
    assert np.array_equal(arr, np.arange(1000, dtype=np.uint32).astype(np.uint8))
    assert not arr.flags.writeable
    with pytest.raises((TypeError, ValueError)):
        arr[0] = 1
    ch.post(m.Shutdown())
    await ch.drain()
    assert await asyncio.to_thread(proc.wait, 30) == 0
    del arr
    assert view.close()


async def test_arena_peer_killed_with_sigkill_leaves_nothing_in_dev_shm() -> None:
    before = shm_entries()
    sock, proc = _spawn_peer("hold", nbytes=8 << 20)
    ch = Channel(sock, name="engine")
    inbox = Inbox(ch)
    hello, _ = await inbox.wait_for(2)
    assert any("diffusiond-arena" in line for line in memfd_maps(proc.pid))
    view = MappedView(hello.fds[0], hello.msg.arena_bytes)  # type: ignore[attr-defined]
    os.kill(proc.pid, signal.SIGKILL)
    assert await asyncio.to_thread(proc.wait, 30) == -signal.SIGKILL
    reason = await asyncio.wait_for(inbox.closed, 10)
    assert isinstance(reason, ChannelClosed)
    assert shm_entries() == before
    assert view.close()
    assert not any("diffusiond-arena" in line for line in memfd_maps())


async def test_a_frame_whose_handling_fails_loses_none_read_with_it(caplog: pytest.LogCaptureFixture) -> None:
    """Frames arrive several to a read: an exception in one's handler dropped the rest of the read (an
    OUTPUT_READY among them would have held its slot and left its job waiting until its deadline)."""
    a, b = await pair()
    Inbox(a)
    got: list[int] = []

    def handle(frame: Frame) -> None:
        got.append(frame.msg.step)
        if frame.msg.step == 0:
            raise RuntimeError("a bug in the first frame's handler")

    b.start(handle, lambda reason: None)
    for i in range(3):
        a.post(m.Progress(batch_id=1, step=i, total=3))
    for _ in range(300):
        if len(got) == 3:
            break
        await asyncio.sleep(0.01)
    assert got == [0, 1, 2] and not b.closed
    assert "handling PROGRESS frame" in caplog.text and "a bug in the first frame's handler" in caplog.text
    a.close()
    b.close()


async def test_drain_below_0_returns_once_every_queued_frame_is_sent() -> None:
    """What a worker awaits before it exits: ``drain()`` alone returned under the high-water mark with frames
    still queued, which the exit then lost."""
    a, b = await pair()
    a.start(lambda frame: None, lambda reason: None)
    posted = 0
    while a.pending_bytes < 256 * 1024:  # past the socket's buffer: the peer reads nothing yet
        a.post(m.Progress(batch_id=1, step=posted, total=1))
        posted += 1
    await asyncio.wait_for(a.drain(), 5)  # under the high-water mark: returns with bytes queued
    assert a.pending_bytes > 0
    flushed = asyncio.ensure_future(a.drain(below=0))
    await asyncio.sleep(0.1)
    assert not flushed.done(), "nothing was read: bytes are still queued"
    inbox = Inbox(b)
    await asyncio.wait_for(flushed, 30)
    assert a.pending_bytes == 0
    assert len(await inbox.wait_for(posted)) == posted
    a.close()
    b.close()


def test_received_fds_are_close_on_exec() -> None:
    """An output's memfd received by a program must not pass to the programs it runs."""
    import fcntl

    from diffusiond.ipc.channel import recv_with_fds

    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    r, w = os.pipe()
    try:
        os.set_inheritable(r, True)
        socket.send_fds(a, [b"x"], [r])
        data, fds = recv_with_fds(b)
        assert data == b"x" and len(fds) == 1
        assert fcntl.fcntl(fds[0], fcntl.F_GETFD) & fcntl.FD_CLOEXEC
        os.close(fds[0])
    finally:
        for fd in (r, w):
            os.close(fd)
        a.close()
        b.close()
