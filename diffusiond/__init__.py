"""diffusiond: a local generation daemon for diffusion models.

The package is three layers that import one way: ``daemon`` (engine process, HTTP API, workers)
uses ``pipelines`` (adapters over diffusers) and ``ipc`` (frames, shared-memory arena, tensor
descriptors); ``ipc`` imports neither. ``cli`` talks to a running daemon over its socket.
"""

__version__ = "0.1.0"
