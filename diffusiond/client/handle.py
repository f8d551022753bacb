"""A submitted job as the async client holds it: follow it, wait for it, cancel it, fetch its outputs.

Kept apart from ``aio.py`` because its lifetime rules differ from the client's: a handle dropped
while its job may still run cancels the job through a finalizer, and that finalizer must only
schedule work on the client's loop, never run it where the GC happens to run.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import AsyncGenerator, Callable, Coroutine
from contextlib import aclosing
from typing import TYPE_CHECKING, Any, Literal, Protocol, overload

from diffusiond.client.errors import DaemonError, JobFailed
from diffusiond.client.outputs import decoded, image_of
from diffusiond.client.params import Output
from diffusiond.protocol import FORMAT_OF_CONTENT_TYPE, TERMINAL_STATUSES, JobStatus

if TYPE_CHECKING:
    from numpy.typing import NDArray
    from PIL import Image


CANCEL_GRACE_S = 5.0
"""How long a cancel on the way out (an interrupt, a dropped handle, a timeout) may take."""

EventCallback = Callable[[str, dict[str, Any]], None]


class JobOwner(Protocol):
    """What a handle needs of the client that made it (``AsyncClient``): named here, so the handle
    does not import the client that imports it."""

    async def job(self, job_id: str) -> dict[str, Any]: ...
    def events(self, job_id: str) -> AsyncGenerator[tuple[str, dict[str, Any]], None]: ...
    async def wait(self, job_id: str, *, timeout: float | None = None,
                   on_event: EventCallback | None = None) -> dict[str, Any]: ...
    async def cancel(self, job_id: str) -> dict[str, Any]: ...
    async def output(self, job_id: str, k: int) -> bytes: ...
    async def array(self, job_id: str, k: int) -> NDArray[Any]: ...
    async def trajectory(self, job_id: str, k: int, *, as_torch: bool = False) -> dict[str, Any]: ...
    async def audio(self, job_id: str, k: int) -> tuple[NDArray[Any], int]: ...
    def cancel_soon(self, job_id: str) -> asyncio.Task[dict[str, Any] | None]: ...
    def cancel_from_any_thread(self, job_id: str) -> None: ...


class AsyncJobHandle:
    """A submitted job: follow it, wait for it, cancel it, fetch its outputs.

    A handle dropped while its job may still run cancels the job (on the client's loop, if it
    still runs): nobody is left to read the outputs, and a GPU should not compute for nobody.
    Waiting, events and cancelling update ``job``, the last state seen, and once the handle has
    seen the job end, dropping it costs nothing.
    """

    def __init__(self, client: JobOwner, job: dict[str, Any]) -> None:
        self.client = client
        self.id = str(job["id"])
        self.job = job
        self._finalizer = weakref.finalize(self, _cancel_dropped, client, self.id)
        self._finalizer.atexit = False  # at exit no loop runs to send it
        self._seen(job)

    def __repr__(self) -> str:
        return f"<AsyncJobHandle {self.id} {self.job.get('status')}>"

    @property
    def finished(self) -> bool:
        return self.job.get("status") in TERMINAL_STATUSES

    def _seen(self, job: dict[str, Any]) -> dict[str, Any]:
        if "status" in job:
            self.job = job
            if self.finished:
                self._finalizer.detach()
        return job

    async def refresh(self) -> dict[str, Any]:
        """The job as the daemon describes it now."""
        return self._seen(await self.client.job(self.id))

    async def events(self) -> AsyncGenerator[tuple[str, dict[str, Any]], None]:
        """(name, data) events until ``done`` or ``error`` (see ``AsyncClient.events``)."""
        async with aclosing(self.client.events(self.id)) as events:
            async for name, data in events:
                if name != "progress":
                    self._seen(data)
                yield name, data

    async def wait(self, timeout: float | None = None, *, on_event: EventCallback | None = None) -> dict[str, Any]:
        """The final job, failed or cancelled ones included (look at ``status``); ClientTimeout
        after ``timeout`` leaves the job running. Cancelling the task that waits cancels the job."""
        if self.finished:
            return self.job
        return self._seen(await self._interruptible(self.client.wait(self.id, timeout=timeout, on_event=on_event)))

    async def cancel(self) -> dict[str, Any]:
        """Cancel the job and return it; a job that had already finished is returned as it ended."""
        return self._seen(await cancel_or_ended(self.client, self.id))

    @overload
    async def outputs(self, output: Literal["pil"] = ...) -> list[Image.Image]: ...
    @overload
    async def outputs(self, output: Literal["array"]) -> list[NDArray[Any]]: ...
    @overload
    async def outputs(self, output: Literal["bytes"]) -> list[bytes]: ...

    async def outputs(self, output: Output = "pil") -> list[Any]:
        """Every output in index order, once the job has ended; JobFailed unless it succeeded.

        ``npy`` outputs come as arrays (``"pil"`` turns uint8 images into images); encoded ones
        are decoded for ``"pil"`` and ``"array"``. An ``npy`` output can be read once only (the
        daemon then frees its memory): ask for it once, or ask for an encoded format.
        """
        return await self._fetch(output, await self.wait())

    async def trajectory(self, k: int = 0, *, as_torch: bool = False) -> dict[str, Any]:
        """Output ``k``'s trajectory once the job has finished: ``latents``, ``log_probs``, ``timesteps``,
        ``sigmas`` (those it asked for) as read-only arrays over the daemon's memory (``as_torch``: tensors)."""
        job = await self.wait()
        if job.get("status") != JobStatus.SUCCEEDED:
            raise JobFailed(job)
        return await self.client.trajectory(self.id, k, as_torch=as_torch)

    async def audio(self, k: int = 0) -> tuple[NDArray[Any], int]:
        """Output ``k``'s sound track once the job has finished (``AsyncClient.audio``): a read-only float32
        ``(channels, samples)`` array and its sample rate."""
        job = await self.wait()
        if job.get("status") != JobStatus.SUCCEEDED:
            raise JobFailed(job)
        return await self.client.audio(self.id, k)

    async def _fetch(self, output: Output, job: dict[str, Any]) -> list[Any]:
        if job.get("status") != JobStatus.SUCCEEDED:
            raise JobFailed(job)
        found: list[Any] = []
        for out in sorted(job.get("outputs") or [], key=lambda o: int(o.get("index", 0))):
            k, ctype = int(out.get("index", 0)), str(out.get("content_type") or "").split(";")[0].strip()
            if output != "bytes" and FORMAT_OF_CONTENT_TYPE.get(ctype) == "npy":
                array = await self.client.array(self.id, k)
                found.append(array if output == "array" else image_of(array))
                continue
            data = await self.client.output(self.id, k)
            found.append(data if output == "bytes" else
                         decoded(data, output == "array", f"output {k} of job {self.id} ({ctype or 'no type'})"))
        return found

    async def _interruptible(self, work: Coroutine[Any, Any, dict[str, Any]]) -> dict[str, Any]:
        try:
            return await work
        except asyncio.CancelledError:  # Ctrl-C under asyncio.run, a task cancelled, a sync caller's interrupt
            await self._cancel_on_the_way_out()
            raise

    async def _cancel_on_the_way_out(self) -> None:
        self._finalizer.detach()  # one cancel is enough
        await asyncio.wait({self.client.cancel_soon(self.id)}, timeout=CANCEL_GRACE_S)


async def cancel_or_ended(client: JobOwner, job_id: str) -> dict[str, Any]:
    """Cancel the job and return it. A cancel refused with 409 means the job had already ended (perhaps
    cancelled: a race with another cancel, or with its deadline), so it is asked for and returned as it ended:
    a caller is told what became of it rather than an error."""
    try:
        return await client.cancel(job_id)
    except DaemonError as exc:
        if exc.status != 409:
            raise
    return await client.job(job_id)


def _cancel_dropped(client: JobOwner, job_id: str) -> None:
    """The finalizer of a handle dropped unfinished. Runs wherever the GC runs, so the client only
    schedules the cancel on its loop, and only while that loop runs and its pool is open."""
    client.cancel_from_any_thread(job_id)
