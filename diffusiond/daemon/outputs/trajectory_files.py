"""Trajectories in the state dir (issue 29): a durable job's arrays saved beside its outputs.

With a state dir a job's outputs outlive the daemon; a trainer that reads a rollout after a restart
needs its trajectory too, or the picture is of no use to it. So when an output's file is written,
each of its trajectory arrays is written beside it as an ``.npy`` file of its own
(``<job>-<k>.<name>.npy``, header included, the bytes the HTTP API serves), listed in the job's row,
counted in its bytes and deleted with it. The shared-memory copy stays the one served while it is
kept (zero-copy leases); once it is gone (retention, a restart) the files are served, over HTTP only.
Without a state dir (``--no-persist``) nothing is written: trajectories live in memory, as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any

from diffusiond.daemon.outputs.encoders import npy_header
from diffusiond.ipc.tensors import numpy_dtype

if TYPE_CHECKING:
    from diffusiond.daemon.core.jobs import Item
    from diffusiond.daemon.outputs.file_reads import FileReads
    from diffusiond.daemon.state.store import Store
    from diffusiond.ipc.tensors import TensorDesc


async def write(item: Item, view: Callable[[TensorDesc], memoryview], executor: Executor, store: Store) -> None:
    """Write the item's trajectory arrays (if it has any in memory) as files, each array's bytes from ``view``
    (``Trajectories.save`` pins the region meanwhile); raises what the store raises."""
    traj = item.trajectory
    if traj is None or item.trajectory_files:
        return
    loop = asyncio.get_running_loop()
    files: dict[str, dict[str, Any]] = {}
    for name, desc in traj.arrays.items():
        payload = view(desc)
        try:
            parts: list[bytes | memoryview] = [npy_header(numpy_dtype(desc.dtype), desc.shape), payload]
            file, size = await loop.run_in_executor(executor, store.write_output, item.job.id, item.index,
                                                    f"{name}.npy", parts)
        finally:
            payload.release()
        files[name] = {"file": file, "bytes": size, "shape": list(desc.shape), "dtype": desc.dtype}
    item.trajectory_files = files


def listed(item: Item) -> dict[str, tuple[list[int], str]]:
    """Each saved array's shape and dtype (what the job's JSON shows once memory no longer holds them)."""
    return {name: (list(f["shape"]), str(f["dtype"])) for name, f in (item.trajectory_files or {}).items()}


async def read(item: Item, name: str, files: FileReads) -> bytes:
    """A saved array's whole npy file (a 404 if its job is being deleted or the file went meanwhile)."""
    entry = (item.trajectory_files or {})[name]
    return await files.read(item.job.id, entry["file"], f"the {name} of output {item.index}", entry.get("bytes"))
