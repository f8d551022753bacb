"""Descriptors that arrive on a channel whose frames go wrong are closed with it, never left open in the
receiving process: a long-running engine or worker that kept each one would run out of descriptors.

The peer here is a raw socket, so each test puts exactly the bytes and descriptors it means on the wire; each
descriptor is a memfd with a name of its own, so counting ``/proc/self/fd`` finds the receiver's copies only.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Callable

from workerkit import config

from diffusiond.ipc import messages as m
from diffusiond.ipc.channel import Channel, socketpair
from diffusiond.ipc.errors import ChannelClosed, ProtocolError
from diffusiond.ipc.frames import Frame, FrameEncoder


def open_copies(tag: str) -> int:
    n = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            n += tag in os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # the listing's own descriptor, gone once listed
            pass
    return n


def send(sock: socket.socket, data: bytes, tag: str, nfds: int) -> None:
    """``data`` with ``nfds`` new memfds named ``tag`` on its first byte; the sender keeps no copy."""
    fds = [os.memfd_create(tag) for _ in range(nfds)]
    try:
        if fds:
            socket.send_fds(sock, [data], fds)
        else:
            sock.sendall(data)
    finally:
        for fd in fds:
            os.close(fd)


def progress(step: int) -> m.Progress:
    return m.Progress(batch_id=1, step=step, total=2)


async def receive(on_frame: Callable[[Channel, Frame], None]) -> tuple[socket.socket,
                                                                           asyncio.Future[BaseException | None]]:
    """A started channel (the loop's reader keeps it), its raw peer, and what it closed with."""
    mine, theirs = socketpair()
    channel = Channel(mine, name="receiver")
    closed: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()
    channel.start(lambda frame: on_frame(channel, frame),
                  lambda reason: None if closed.done() else closed.set_result(reason))
    return theirs, closed


def keep(channel: Channel, frame: Frame) -> None:
    for fd in frame.fds:  # a handler that took them closes them itself
        os.close(fd)


async def test_the_fds_of_a_frame_that_fails_its_checksum_are_closed_with_the_channel() -> None:
    peer, closed = await receive(keep)
    data = bytearray(FrameEncoder().encode(progress(0), 2))
    data[-1] ^= 0xFF
    send(peer, bytes(data), "corrupt-frame", 2)
    reason = await asyncio.wait_for(closed, 10)
    assert isinstance(reason, ProtocolError) and "checksum" in str(reason)
    assert open_copies("corrupt-frame") == 0
    peer.close()


async def test_fds_short_of_what_the_frame_announces_are_closed_with_the_channel() -> None:
    peer, closed = await receive(keep)
    send(peer, FrameEncoder().encode(progress(0), 3), "short-of-announced", 2)
    reason = await asyncio.wait_for(closed, 10)
    assert isinstance(reason, ProtocolError) and "announces 3 fds, 2 arrived" in str(reason)
    assert open_copies("short-of-announced") == 0
    peer.close()


async def test_the_fds_of_frames_read_behind_one_that_closes_the_channel_are_closed() -> None:
    def close_on_first(channel: Channel, frame: Frame) -> None:
        keep(channel, frame)
        channel.close(ChannelClosed("the first frame ends it"))

    peer, closed = await receive(close_on_first)
    encoder = FrameEncoder()
    send(peer, encoder.encode(progress(0), 0), "behind-a-close", 0)  # both written before the channel reads
    send(peer, encoder.encode(progress(1), 2), "behind-a-close", 2)
    assert "first frame ends it" in str(await asyncio.wait_for(closed, 10))
    assert open_copies("behind-a-close") == 0
    peer.close()


async def test_the_fds_of_a_frame_cut_off_by_a_hang_up_are_closed_with_the_channel() -> None:
    peer, closed = await receive(keep)
    data = FrameEncoder().encode(progress(0), 2)
    send(peer, data[: len(data) - 3], "cut-off-frame", 2)
    peer.close()
    reason = await asyncio.wait_for(closed, 10)
    assert isinstance(reason, ChannelClosed) and "peer closed" in str(reason)
    assert open_copies("cut-off-frame") == 0


class _Closed:
    def __init__(self) -> None:
        self.reasons: list[BaseException | None] = []

    def close(self, reason: BaseException | None = None) -> None:
        self.reasons.append(reason)


def test_the_engine_closes_the_fds_of_an_output_frame_it_refuses() -> None:
    """An output frame whose descriptors do not match its dedicated buffers is a protocol error; the engine's
    handle is the only one holding those descriptors then, so it closes them as it refuses the frame."""
    from diffusiond.daemon.workers.handle import WorkerHandle
    from diffusiond.ipc.tensors import TensorDesc

    handle = WorkerHandle(config(), on_frame=lambda *_: None,
                          on_lost=lambda *_: None)
    closed = _Closed()
    handle.channel = closed  # type: ignore[assignment]
    desc = TensorDesc(dtype="uint8", shape=(4,), nbytes=4, slot_id=1, dedicated=True)
    fds = [os.memfd_create("refused-output") for _ in range(2)]  # one buffer, two descriptors
    handle._on_frame(Frame(m.Kind.OUTPUT_READY, 0, m.OutputReady(request_id="r", batch_id=1, tensor=desc), fds))
    assert isinstance(closed.reasons[0], ProtocolError)
    assert open_copies("refused-output") == 0
