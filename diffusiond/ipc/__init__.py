"""The transport between the engine and its workers, kept free of daemon and pipeline imports.

- ``frames``: fixed binary header + msgspec body, per-direction sequence numbers, size limit.
- ``messages``: the typed body of every frame kind (the worker protocol).
- ``channel``: async framed transport over an AF_UNIX stream socket, with SCM_RIGHTS fd passing.
- ``arena``: memfd-backed slot arena (owner read-write, peer read-only) and dedicated buffers.
- ``tensors``: descriptors for tensors in the arena; exact-view writes, zero-copy reads.
"""
