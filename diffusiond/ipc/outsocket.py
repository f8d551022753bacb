"""The output socket's frames: a program on the same machine takes an output by file descriptor.

Kept apart from ``messages.py`` (which re-exports them and numbers every kind) so that module stays
one screenful of the worker protocol; nothing here is the worker's.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from diffusiond.ipc.tensors import TensorDesc


class Fetch(msgspec.Struct, frozen=True):
    """Ask for output ``index`` of job ``job_id`` (``part`` "trajectory": its trajectory's arrays; "audio": its
    sound track's, which share that memory);
    the answer is LEASE (fd attached) or REFUSED."""

    job_id: str
    index: int
    part: Literal["output", "trajectory", "audio"] = "output"


class Lease(msgspec.Struct, frozen=True):
    """The output lies at ``tensor.offset`` of the attached fd (``map_bytes`` long, sealed: it maps
    read-only). The engine keeps the slot until UNPIN or the connection closes."""

    lease: int
    tensor: TensorDesc
    map_bytes: int
    arrays: dict[str, TensorDesc] = {}  # a trajectory's arrays (``tensor`` is then their region)


class Refused(msgspec.Struct, frozen=True):
    """No fd for this fetch: the HTTP status and the error body the HTTP API would have given."""

    job_id: str
    index: int
    status: int
    code: str
    message: str


class Unpin(msgspec.Struct, frozen=True):
    """The client dropped every array over this lease: its slot may go back."""

    lease: int
