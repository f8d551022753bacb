"""What the engine and the worker template say to each other (issue 27's cold start, ``worker/template.py``).

One message per datagram on a SOCK_SEQPACKET socketpair, msgpack-encoded, nothing pickled. The engine sends FORK
with the new worker's channel socket attached (SCM_RIGHTS); the template answers FORKED with the child's pid and its
pidfd attached, opened before the template can reap it (or why it could not fork), and EXITED as each child it
forked ends. Its first message says whether it is usable at all: READY, or UNUSABLE with why (the engine then starts
workers as fresh interpreters).
"""

from __future__ import annotations

import socket

import msgspec

MAX_MESSAGE = 1 << 16  # an env of a few variables; anything near this is a bug


class Fork(msgspec.Struct, tag="fork", frozen=True):
    """Start a worker on the attached fd. ``env`` is what the handle sets over the engine's own environment
    (the template has the engine's, from its spawn), applied before anything in the child reads it."""

    seq: int  # the engine's number for this request; FORKED answers with it
    env: dict[str, str] = {}
    log_level: str = "INFO"


class Forked(msgspec.Struct, tag="forked", frozen=True):
    seq: int
    pid: int = 0  # 0: no child (``error`` says why)
    error: str = ""


class Exited(msgspec.Struct, tag="exited", frozen=True):
    """A forked child ended: ``returncode`` as asyncio's Process has it (negative: killed by that signal)."""

    pid: int
    returncode: int


class Status(msgspec.Struct, tag="status", frozen=True):
    """The template's first message: its imports are done and it can fork (``ready``), or why it cannot."""

    ready: bool
    why: str = ""
    pid: int = 0


ToTemplate = Fork
FromTemplate = Forked | Exited | Status

_ENCODER = msgspec.msgpack.Encoder()
_TO_TEMPLATE = msgspec.msgpack.Decoder(ToTemplate)
_FROM_TEMPLATE = msgspec.msgpack.Decoder(FromTemplate)


def encode(msg: Fork | Forked | Exited | Status) -> bytes:
    return _ENCODER.encode(msg)


def decode_request(data: bytes) -> Fork:
    return _TO_TEMPLATE.decode(data)


def decode_reply(data: bytes) -> Forked | Exited | Status:
    return _FROM_TEMPLATE.decode(data)


def socketpair() -> tuple[socket.socket, socket.socket]:
    """Datagrams that keep their bounds and carry fds; neither end is inherited by a spawned process."""
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
