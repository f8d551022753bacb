"""The transport between the engine and its workers, kept free of daemon and pipeline imports.

The one import from the rest of the package is ``diffusiond.protocol``, the stdlib-only vocabulary
module (``messages`` takes ``OutputDtype`` and ``OutputMode`` from it), so the engine and the
worker agree on those names with the HTTP API without ``ipc`` depending on either side.

- ``frames``: fixed binary header + msgspec body, per-direction sequence numbers, size limit.
- ``messages``: the typed body of every frame kind (the worker protocol).
- ``channel``: async framed transport over an AF_UNIX stream socket, with SCM_RIGHTS fd passing.
- ``arena``: memfd-backed slot arena (owner read-write, peer read-only) and dedicated buffers.
- ``tensors``: descriptors for tensors in the arena; exact-view writes, zero-copy reads.
- ``cuda_host``: the arena's mapping registered with CUDA once, so device-to-host copies run at bus speed.
- ``inputs``: an edit's images (and control and reference pictures) in one sealed memfd per job.
- ``outsocket``: the output socket's frames (a local program takes an output by fd).
- ``upscale``: a batch's hires pass and upscaler, as they travel in ``BatchParams``.
- ``errors``: the layer's exceptions, each naming the values involved.
"""
