"""The client library: how any program on the machine talks to a running diffusiond.

    aio.py        AsyncClient: HTTP over the Unix socket, SSE, outputs as PIL, numpy or bytes
    connection.py the pool under it, and each request's failure made one of the tree below
    arrays.py     outputs as arrays (npy, trajectories, sound): shared memory where it works, else HTTP
    handle.py     AsyncJobHandle: one submitted job (a dropped, unfinished handle cancels it)
    sync.py       Client and JobHandle: the same on a private loop in a background thread
    params.py     the job parameters a caller may pass, and the body they make
    transport.py  reading the daemon's answers: JSON, errors, Server-Sent Events
    outputs.py    decoding outputs; arrays mapped from shared memory stay alive while used
    zerocopy.py   outputs mapped from the daemon's shared memory (same machine, same user)
    weights.py    update_lora, update_weights: a trainer's tensors sent to the daemon by fd
    errors.py     the exception tree below

Every failure a caller can meet comes out as one of these, so ``except ClientError`` is enough to
keep aiohttp's and asyncio's own exceptions out of a caller's code:

    ClientError
    ├── DaemonUnreachable    nothing answers on the socket, or the connection died mid-answer
    ├── DaemonError          the daemon answered with an error: status, code, message, field,
    │   │                    stage, retry_after (HTTP 4xx/5xx, or an answer that made no sense)
    │   └── UpdateSplit      a live update (update_lora/update_weights) that some workers of a model
    │                        applied and others did not (409 update_split): send it again
    ├── ClientTimeout        a request, or a wait for a job, took longer than the caller allowed
    │                        (also a ``TimeoutError``, which is what such code caught before)
    ├── JobFailed            ``generate`` (or ``outputs``) met a job that failed or was cancelled:
    │                        job_id, status, code, message, stage, and the job itself
    └── ZeroCopyUnavailable  (``diffusiond.client.zerocopy``) no shared-memory path to the outputs here

A job that fails or is cancelled is not an exception for ``wait``: it returns the job, whose
``status`` and ``error`` say what happened, because a caller that waits on a handle asked about
the job; ``generate`` asked for images, so it raises JobFailed. Writing an output to a file can
still raise ``OSError``; that is the caller's file, not the daemon.

Nothing here imports the daemon, the workers or torch (tests/test_layout.py holds it); only
``zerocopy.py`` and ``weights.py`` reach into ``ipc``, for its frames and descriptors.
"""

from __future__ import annotations

from diffusiond.client.aio import BASE_URL, AsyncClient, EventCallback
from diffusiond.client.errors import (
    ClientError,
    ClientTimeout,
    DaemonError,
    DaemonUnreachable,
    JobFailed,
    UpdateSplit,
)
from diffusiond.client.handle import AsyncJobHandle
from diffusiond.client.params import JobParams, Output
from diffusiond.client.sync import Client, JobHandle
from diffusiond.client.transport import SSEParser
from diffusiond.protocol import default_socket_path

__all__ = [
    "BASE_URL", "AsyncClient", "AsyncJobHandle", "Client", "ClientError", "ClientTimeout", "DaemonError",
    "DaemonUnreachable", "EventCallback", "JobFailed", "JobHandle", "JobParams", "Output", "SSEParser",
    "UpdateSplit", "default_socket_path",
]  # fmt: skip
