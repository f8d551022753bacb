"""A protocol violation behind whole frames in the same read: the frames before it are handled, then the
channel closes with the violation. Before, the decoder raised and dropped them, so an output that had landed
(its OUTPUT_READY was intact) failed its job with the worker's protocol error."""

from __future__ import annotations

import asyncio
import zlib

import pytest

from diffusiond.ipc import messages as m
from diffusiond.ipc.channel import Channel, socketpair
from diffusiond.ipc.errors import ProtocolError
from diffusiond.ipc.frames import HEADER, MAGIC, VERSION, Frame, FrameDecoder, FrameEncoder


def _good_then_gap() -> bytes:
    enc = FrameEncoder()
    good = enc.encode(m.Progress(batch_id=1, step=1, total=2))
    enc.next_seq += 1  # a frame lost on the way: the next one is a gap
    return good + enc.encode(m.Progress(batch_id=1, step=2, total=2))


def test_the_decoder_returns_the_frames_before_a_violation_then_raises_it() -> None:
    dec = FrameDecoder()
    (frame,) = dec.feed(_good_then_gap())
    assert frame[3] == m.Progress(batch_id=1, step=1, total=2)
    with pytest.raises(ProtocolError, match="expected 1, received 2"):
        dec.feed(b"")


def test_a_truncated_or_lying_header_is_a_protocol_error_without_buffering_its_claim() -> None:
    dec = FrameDecoder(max_body=1024)
    with pytest.raises(ProtocolError, match="exceeds the limit of 1024"):
        dec.feed(HEADER.pack(MAGIC, VERSION, int(m.Kind.PROGRESS), 0, 0, 0xFFFFFFFF, 0))
    body = b"\x93\x01"  # a 3-element array cut short
    dec = FrameDecoder()
    with pytest.raises(ProtocolError, match="invalid body"):
        dec.feed(HEADER.pack(MAGIC, VERSION, int(m.Kind.PROGRESS), 0, 0, len(body), zlib.crc32(body)) + body)


async def test_the_channel_hands_on_the_frames_before_a_violation_then_closes_with_it() -> None:
    a, b = socketpair()
    ch = Channel(b, name="engine side")
    got: list[Frame] = []
    closed: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()
    ch.start(got.append, lambda reason: closed.done() or closed.set_result(reason))
    a.sendall(_good_then_gap())
    reason = await asyncio.wait_for(closed, 30)
    a.close()
    assert [f.msg for f in got] == [m.Progress(batch_id=1, step=1, total=2)]
    assert isinstance(reason, ProtocolError) and "expected 1, received 2" in str(reason)
