"""Frame encoding: a fixed binary header, then a msgpack body of the struct for that kind.

Header (24 bytes, network order)::

    magic "DFSD" | version u8 | kind u8 | nfds u16 | seq u64 | body_len u32 | body_crc32 u32

``seq`` counts frames per direction from 0. The decoder insists on exactly the next number, so a
dropped, repeated or reordered frame is a ``ProtocolError`` that names both numbers instead of a
request that waits forever. ``body_crc32`` catches corruption that still parses. ``nfds`` is the
count of file descriptors that travel with the frame's first byte (SCM_RIGHTS).

The size limit is checked at the sender (``FrameTooLarge``, with both sizes) and again at the
receiver (``ProtocolError``), so an oversize frame never reaches the wire and a corrupt length
never makes the reader buffer gigabytes.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, field

import msgspec

from diffusiond.ipc.errors import FrameTooLarge, ProtocolError
from diffusiond.ipc.messages import KIND_OF, TYPE_OF, Kind

MAGIC = b"DFSD"
VERSION = 1
HEADER = struct.Struct("!4sBBHQII")
HEADER_SIZE = HEADER.size
KIND_OFFSET = 5  # byte offset of ``kind`` in the header (fault injection in tests reads it)
MAX_FDS = 16  # an update's parts (updates.MAX_PARTS); a batch's edit inputs, one each
DEFAULT_MAX_BODY = 4 << 20  # frames carry descriptors; 4 MiB is far above any real one


@dataclass(frozen=True, slots=True)
class Frame:
    kind: Kind
    seq: int
    msg: msgspec.Struct
    fds: list[int] = field(default_factory=list)


class FrameEncoder:
    """Turns messages into wire bytes and numbers them. One per sending direction."""

    def __init__(self, max_body: int = DEFAULT_MAX_BODY) -> None:
        self.max_body = max_body
        self.next_seq = 0
        self._encoder = msgspec.msgpack.Encoder()

    def encode(self, msg: msgspec.Struct, nfds: int = 0) -> bytes:
        try:
            kind = KIND_OF[type(msg)]
        except KeyError:
            raise TypeError(f"{type(msg).__name__} is not a protocol message") from None
        if not 0 <= nfds <= MAX_FDS:
            raise ValueError(f"{nfds} fds with one frame; at most {MAX_FDS}")
        body = self._encoder.encode(msg)
        if len(body) > self.max_body:
            raise FrameTooLarge(
                f"{kind.name} frame body is {len(body)} bytes, over the limit of {self.max_body} bytes; "
                "frames carry descriptors, bulk data belongs in the arena"
            )
        header = HEADER.pack(MAGIC, VERSION, kind, nfds, self.next_seq, len(body), zlib.crc32(body))
        self.next_seq += 1
        return header + body


class FrameDecoder:
    """Incremental decoder: feed it bytes, get whole frames; any violation is a ProtocolError."""

    def __init__(self, max_body: int = DEFAULT_MAX_BODY) -> None:
        self.max_body = max_body
        self.expected_seq = 0
        self._buf = bytearray()
        self._decoders = {kind: msgspec.msgpack.Decoder(cls) for kind, cls in TYPE_OF.items()}
        # the violation found behind whole frames of the same read: those are returned first, since everything
        # before a violation is as trustworthy as ever (an output announced there is real); then raised for good
        self.broken: ProtocolError | None = None

    @property
    def buffered(self) -> int:
        return len(self._buf)

    def feed(self, data: bytes | memoryview) -> list[tuple[Kind, int, int, msgspec.Struct]]:
        """Returns ``(kind, seq, nfds, msg)`` for each frame completed by ``data``. A violation after whole frames
        returns those and is kept in ``broken`` (raised by the next call); the caller handles them, then checks."""
        if self.broken is not None:
            raise self.broken
        self._buf += data
        out: list[tuple[Kind, int, int, msgspec.Struct]] = []
        try:
            self._decode(out)
        except ProtocolError as exc:
            if not out:
                raise
            self.broken = exc
        return out

    def _decode(self, out: list[tuple[Kind, int, int, msgspec.Struct]]) -> None:
        while len(self._buf) >= HEADER_SIZE:
            magic, version, kind_no, nfds, seq, body_len, crc = HEADER.unpack_from(self._buf)
            if magic != MAGIC:
                raise ProtocolError(f"bad frame magic {bytes(magic)!r}, expected {MAGIC!r}")
            if version != VERSION:
                raise ProtocolError(f"protocol version {version}, this side speaks {VERSION}")
            try:
                kind = Kind(kind_no)
            except ValueError:
                raise ProtocolError(f"unknown frame kind {kind_no}") from None
            if nfds > MAX_FDS:
                raise ProtocolError(f"{kind.name} frame claims {nfds} fds; at most {MAX_FDS}")
            if body_len > self.max_body:
                raise ProtocolError(
                    f"{kind.name} frame body of {body_len} bytes exceeds the limit of {self.max_body}"
                )
            if seq != self.expected_seq:
                what = "repeated or reordered" if seq < self.expected_seq else "gap (frames lost)"
                raise ProtocolError(
                    f"sequence error on {kind.name} frame: expected {self.expected_seq}, received {seq} ({what})"
                )
            end = HEADER_SIZE + body_len
            if len(self._buf) < end:
                break
            body = bytes(self._buf[HEADER_SIZE:end])
            if zlib.crc32(body) != crc:
                raise ProtocolError(f"{kind.name} frame {seq}: body checksum mismatch (corrupted frame)")
            try:
                msg = self._decoders[kind].decode(body)
            except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError) as exc:
                raise ProtocolError(f"{kind.name} frame {seq}: invalid body: {exc}") from None
            del self._buf[:end]
            self.expected_seq += 1
            out.append((kind, seq, nfds, msg))
