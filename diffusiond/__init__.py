"""diffusiond: a local generation daemon for diffusion models.

Three processes and the layer between them, one folder each: ``client/`` (any program's side,
with ``cli.py`` and ``commands/`` for the command line), ``daemon/`` (the engine process),
``worker/`` (the processes that run forwards, over ``pipelines/``), and ``ipc/`` between engine
and worker; ``protocol.py`` is the vocabulary all of them share (docs/architecture.md).

Programs on the same machine use the client: ``with diffusiond.Client() as c: c.generate("a
cat")``, or ``diffusiond.AsyncClient`` under asyncio (docs/api.md, "Python client"). The names
below are loaded on first use, so ``import diffusiond`` alone (which the daemon, the workers and
every CLI command do) loads neither aiohttp nor numpy, PIL or torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from diffusiond.client import (
        AsyncClient,
        AsyncJobHandle,
        Client,
        ClientError,
        ClientTimeout,
        DaemonError,
        DaemonUnreachable,
        JobFailed,
        JobHandle,
    )  # fmt: skip

__all__ = [
    "AsyncClient", "AsyncJobHandle", "Client", "ClientError", "ClientTimeout", "DaemonError", "DaemonUnreachable",
    "JobFailed", "JobHandle", "__version__",
]  # fmt: skip


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'diffusiond' has no attribute {name!r}")
    from diffusiond import client

    value = getattr(client, name)
    globals()[name] = value  # once: later lookups do not come here
    return value
