"""Live weight updates' frames (issue 29's ``update_lora`` and ``update_weights``): a local client's new
weights, the engine's copy of them to each worker, and the answer.

Apart from ``messages.py`` (which re-exports them, as it names every frame kind) because they are one
protocol of their own, spoken on the output socket as well as the worker channel.
"""

from __future__ import annotations

import fcntl

import msgspec

LIVE_PATH = "(live: weights from update_lora)"  # the path a live adapter is listed with: it has no file


MAX_PARTS = 16  # memfds one update may come in: all travel with its one frame, whose fds are at most frames.MAX_FDS.
# 4 GiB written on an H100 host's 16 cores: 1.38-1.45 s into one memfd, 0.15-0.16 s into 16 (docs/benchmarks.md)

# What each part must be sealed against (``fcntl(fd, F_ADD_SEALS, ...)``, a memfd made with MFD_ALLOW_SEALING)
# before it is sent: the workers read it after the call, and a worker started later reads it again from the
# engine's copy of the fd, so its bytes must stay what was sent, and a read never runs past a shrunk end.
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_WRITE


class WeightTensor(msgspec.Struct, frozen=True):
    """One tensor of an update, ``nbytes(dtype, shape)`` bytes at ``offset`` of the memfd ``part`` (its index
    among the frame's fds). An update comes in several memfds, "parts", because the client writes each from a
    thread of its own: ``pwrite`` to one shmem file holds its inode's lock, so threads writing one memfd took
    turns, and a 4.8 GB UNet's pack stayed over a second (issue 29). ``part`` defaults to 0, so a client that
    sends one memfd and no ``part`` still speaks the protocol. Unchecked on decode (no ``__post_init__``): the
    engine checks it and names the bad one."""

    name: str
    dtype: str
    shape: list[int]
    offset: int
    part: int = 0


class UpdateLora(msgspec.Struct, frozen=True):
    """New weights for adapter ``name``, in diffusers/PEFT naming; the tensors lie in the attached
    memfds (``WeightTensor.part`` says which). From a local client to the engine (``version`` unset),
    then from the engine to each worker with the version it assigned; a worker applies it between
    batches and answers ACK."""

    name: str
    tensors: list[WeightTensor]
    version: int = 0
    ack_id: int = 0  # engine -> worker only (messages.Ack.ack_id)


class UpdateWeights(msgspec.Struct, frozen=True):
    """New values for parameters of one component (``unet``, ``transformer``...) of ``model``, by their
    names in its ``state_dict``; the tensors lie in the attached memfds, as for UPDATE_LORA."""

    model: str
    component: str
    tensors: list[WeightTensor]
    version: int = 0
    ack_id: int = 0  # engine -> worker only (messages.Ack.ack_id)


class Updated(msgspec.Struct, frozen=True):
    """Every live worker applied the update: adapter ``name`` is at ``version`` from the next batch on."""

    name: str
    version: int


class UpdateRefused(msgspec.Struct, frozen=True):
    """The update was not applied anywhere: the HTTP status and error body the HTTP API would give."""

    name: str
    status: int
    code: str
    message: str
    field: str | None = None
