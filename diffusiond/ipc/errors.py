"""Errors of the IPC layer. Each message names the values involved so a log line is enough."""

from __future__ import annotations


class IPCError(Exception):
    """Base of every error the IPC layer raises."""


class ProtocolError(IPCError):
    """The byte stream broke the frame protocol: bad header, bad body, or a sequence gap.

    The peer that sees it must treat the channel as dead: nothing after a protocol error can be
    trusted, and waiting for a frame that will never come is how outputs get lost.
    """


class FrameTooLarge(IPCError):
    """A frame body exceeds the limit. Raised at the sender; the frame never reaches the wire."""


class ChannelClosed(IPCError):
    """The channel is closed (peer hung up, protocol error, or closed locally)."""


class ArenaError(IPCError):
    """Misuse of the slot arena (unknown slot, double release, closed arena)."""


class ArenaFull(ArenaError):
    """No slot of the requested size became free within the timeout."""


class SlotTooLarge(ArenaError):
    """The request can never fit in the arena; use a dedicated buffer instead."""
