"""diffusiond: a local generation daemon for diffusion models.

The package is three layers that import one way: ``daemon`` (engine process, HTTP API, workers)
uses ``pipelines`` (adapters over diffusers) and ``ipc`` (frames, shared-memory arena, tensor
descriptors); ``ipc`` imports neither. ``cli`` talks to a running daemon over its socket.

Programs on the same machine use the client: ``with diffusiond.Client() as c: c.generate("a
cat")``, or ``diffusiond.AsyncClient`` under asyncio (docs/api.md, "Python client"). The names
below are loaded on first use, so ``import diffusiond`` alone (which the daemon, the workers and
every CLI command do) loads neither aiohttp nor numpy, PIL or torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from diffusiond.client import AsyncClient, AsyncJobHandle
    from diffusiond.client_errors import ClientError, ClientTimeout, DaemonError, DaemonUnreachable, JobFailed
    from diffusiond.client_sync import Client, JobHandle

__all__ = [
    "AsyncClient", "AsyncJobHandle", "Client", "ClientError", "ClientTimeout", "DaemonError", "DaemonUnreachable",
    "JobFailed", "JobHandle", "__version__",
]  # fmt: skip

_LAZY = {
    "AsyncClient": "client", "AsyncJobHandle": "client", "Client": "client_sync", "JobHandle": "client_sync",
    "ClientError": "client_errors", "ClientTimeout": "client_errors", "DaemonError": "client_errors",
    "DaemonUnreachable": "client_errors", "JobFailed": "client_errors",
}  # fmt: skip


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'diffusiond' has no attribute {name!r}")
    if module == "client":
        from diffusiond import client as found
    elif module == "client_sync":
        from diffusiond import client_sync as found  # type: ignore[no-redef]
    else:
        from diffusiond import client_errors as found  # type: ignore[no-redef]
    value = getattr(found, name)
    globals()[name] = value  # once: later lookups do not come here
    return value
