"""Outputs that come as arrays (an ``npy`` output, a trajectory, a sound track): mapped from the daemon's shared
memory where that works, else read over HTTP.

Apart from ``aio.py`` because the choice between the two paths is a state of its own, kept for the client's life:
the output mapper is opened once and closed off the loop's thread; ``zero_copy=None`` falls back to HTTP for good
the first time mapping cannot work here, and for one output at a time when the daemon says ``not_shared``;
``zero_copy=True`` raises instead. The HTTP path gives what the mapped one gives (the same values, the same names,
trajectories and sound tracks read-only, as records), so both live here side by side; one difference is kept: an
``npy`` output read over HTTP is the caller's own copy and stays writeable (read-only, editing it in place would
cost a copy of the whole output for nothing), where a mapped one is the daemon's memory and cannot be.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, cast

from diffusiond.client.connection import Connection
from diffusiond.client.errors import DaemonError
from diffusiond.client.outputs import open_mapper, read_npy, torch_views
from diffusiond.client.transport import quote_id
from diffusiond.protocol import AUDIO_ARRAY, ErrorCode

if TYPE_CHECKING:
    from numpy.typing import NDArray

    from diffusiond.client.zerocopy import OutputMapper


class ArrayReader:
    """``AsyncClient.array``, ``trajectory`` and ``audio`` (their docstrings are the contract), and the output
    mapper they share: over the client's ``connection`` (its pool, socket and timeout), with its ``job`` (a job's
    JSON, which names a trajectory's or a sound track's arrays) and its ``zero_copy``."""

    def __init__(self, connection: Connection, job: Callable[[str], Awaitable[dict[str, Any]]],
                 zero_copy: bool | None) -> None:
        self.connection = connection
        self.job = job
        self.zero_copy = zero_copy
        self._mapper: OutputMapper | None = None
        self._mapper_lock = asyncio.Lock()
        self._no_zero_copy = zero_copy is False

    async def close(self) -> None:
        await self._drop_mapper(self._mapper)  # it may wait for a fetch under way (up to its timeout)

    async def array(self, job_id: str, k: int) -> NDArray[Any]:
        mapped = await self._shared(lambda m: m.array(job_id, k))
        if mapped is not None:
            return cast("NDArray[Any]", mapped)
        async with self.connection._request("GET", f"/v1/jobs/{quote_id(job_id)}/outputs/{int(k)}") as resp:
            return await read_npy(resp.content)  # a short body: DaemonError bad_response

    async def trajectory(self, job_id: str, k: int, *, as_torch: bool = False) -> dict[str, Any]:
        mapped = await self._shared(lambda m: m.trajectory(job_id, k, "trajectory"))
        arrays: dict[str, NDArray[Any]] = await self._trajectory_over_http(job_id, k) if mapped is None else {
            name: a for name, a in mapped.items() if name != AUDIO_ARRAY}  # the region holds the sound track too
        if not as_torch:
            return arrays
        words = any(a.dtype.kind == "u" and a.dtype.itemsize == 2 for a in arrays.values())  # bfloat16, maybe
        return torch_views(arrays, await self._dtypes(job_id, k) if words else {})

    async def audio(self, job_id: str, k: int) -> tuple[NDArray[Any], int]:
        entry = await self._side_entry(job_id, k, "audio")
        mapped = await self._shared(lambda m: m.trajectory(job_id, k, "audio"))
        if mapped is not None:
            return mapped[AUDIO_ARRAY], int(entry["sample_rate"])
        path = f"/v1/jobs/{quote_id(job_id)}/outputs/{int(k)}/trajectory/audio"
        async with self.connection._request("GET", path) as resp:
            waveform = await read_npy(resp.content)
        waveform.flags.writeable = False  # as the mapped one
        return waveform, int(entry["sample_rate"])

    async def _shared(self, read: Callable[[OutputMapper], Any]) -> Any:
        """``read``'s array (or name -> array) over the daemon's shared memory; None: read it over
        HTTP instead (no output socket here, or this one is not in shared memory: spilled under arena pressure,
        or an old kernel; the next may be mapped again)."""
        mapper = await self._zero_copy_mapper()
        if mapper is None:
            return None
        from diffusiond.client.zerocopy import ZeroCopyUnavailable

        try:
            return await asyncio.to_thread(read, mapper)
        except ZeroCopyUnavailable:
            if self.zero_copy:
                if mapper.closed:  # hung up (a timeout, a bad frame): the next call connects afresh
                    await self._drop_mapper(mapper)
                raise
            self._no_zero_copy = True
            await self._drop_mapper(mapper)
            return None
        except DaemonError as exc:
            if exc.code != ErrorCode.NOT_SHARED:
                raise
            if self.zero_copy:  # the documented error
                raise ZeroCopyUnavailable(f"zero_copy=True, but {exc.message}") from exc
            return None

    async def _trajectory_over_http(self, job_id: str, k: int) -> dict[str, NDArray[Any]]:
        entries = await self._side_entry(job_id, k, "trajectory")
        arrays = {}
        for name, entry in entries.items():
            async with self.connection._request("GET", str(entry["url"])) as resp:
                arrays[name] = await read_npy(resp.content)
                arrays[name].flags.writeable = False  # as the mapped ones: a trajectory is a record
        return arrays

    async def _side_entry(self, job_id: str, k: int, key: str) -> dict[str, Any]:
        """What the job's JSON says of output ``k``'s ``trajectory`` or ``audio``."""
        job = await self.job(job_id)
        for out in job.get("outputs") or []:
            if int(out.get("index", -1)) == int(k) and out.get(key):
                return dict(out[key])
        what = "trajectory (not finished, or none asked for)" if key == "trajectory" else \
            "sound track (not finished, its model makes none, or it was sent with audio: false)"
        raise DaemonError(404, ErrorCode.OUTPUT_NOT_FOUND.value, f"output {k} of job {job_id} has no {what}")

    async def _dtypes(self, job_id: str, k: int) -> dict[str, str]:
        entries = await self._side_entry(job_id, k, "trajectory")
        return {name: str(e.get("dtype")) for name, e in entries.items()}

    async def _zero_copy_mapper(self) -> OutputMapper | None:
        """The output mapper, opened once; None once zero-copy is off or known not to work here."""
        async with self._mapper_lock:
            if self._mapper is None and not self._no_zero_copy:
                self._mapper = await open_mapper(self.connection.socket_path, self.connection.timeout, self.zero_copy)
                self._no_zero_copy = self._mapper is None
            return self._mapper

    async def _drop_mapper(self, mapper: OutputMapper | None) -> None:
        """Close ``mapper`` off the loop's thread: closing waits for a fetch under way in another thread, up to
        the mapper's timeout, and every other task of the program would stand still meanwhile."""
        if mapper is not None:
            if self._mapper is mapper:
                self._mapper = None
            await asyncio.to_thread(mapper.close)
