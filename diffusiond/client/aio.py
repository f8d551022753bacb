"""The async client for a running diffusiond, over its Unix socket (the sync ``Client`` wraps it).

The CLI is a thin shell over this module, and Python users (a training loop, a notebook) can use it
directly instead of hand-writing HTTP: it knows the socket-path rules, turns the daemon's JSON errors
into exceptions (the tree is in ``diffusiond.client``'s docstring), follows a job's Server-Sent
Events, streams outputs to files without holding a whole video in memory, and hands outputs over as
PIL images, numpy arrays or bytes. A submitted job is an ``AsyncJobHandle`` (``handle.py``); the
pool and the mapping of a request's failures are ``connection.py``'s, outputs read as arrays
(shared memory or HTTP) ``arrays.py``'s.

It depends on nothing of the daemon (the socket-path rules are in ``diffusiond.protocol``), so
importing it never pulls in torch, the engine, or the encoders; numpy and PIL are imported only
when an output is asked for as an array or an image.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncGenerator, Callable, Mapping
from contextlib import aclosing
from types import TracebackType
from typing import TYPE_CHECKING, Any, BinaryIO, Literal, Unpack, overload

from diffusiond.client.arrays import ArrayReader
from diffusiond.client.connection import BASE_URL, Connection
from diffusiond.client.errors import ClientError, ClientTimeout, DaemonError, DaemonUnreachable
from diffusiond.client.handle import CANCEL_GRACE_S, AsyncJobHandle, EventCallback, cancel_or_ended
from diffusiond.client.params import JobParams, Output, check_finite, job_body, params_for, pil_needs_a_format
from diffusiond.client.transport import (
    SOCKET_WAIT_S,
    SSEParser,
    decode_event,
    error_of,
    parse_json,
    quote_id,
    until_bound,
)
from diffusiond.protocol import (
    TERMINAL_EVENTS,
    TERMINAL_STATUSES,
    ErrorCode,
    default_socket_path,
)  # fmt: skip

if TYPE_CHECKING:
    from numpy.typing import NDArray
    from PIL import Image

__all__ = ["BASE_URL", "AsyncClient", "EventCallback"]

_CHUNK = 256 * 1024
_RESUBSCRIBE = 3
"""How often ``wait`` re-opens an event stream the daemon closed before the job ended."""

START_WAIT_S = 900.0
"""How long a submit waits for a daemon that is still loading its models (the daemon's own
default bound on a model load)."""


class AsyncClient(Connection):
    """One connection pool to one daemon. Use ``async with AsyncClient() as c:`` or ``close()``.

    ``timeout`` bounds every request, an event stream included, so leave it ``None`` when
    following jobs that may run long (``wait`` takes its own bound); connecting is bounded
    either way (30 s at most). With ``None`` nothing else is: a daemon that took the connection
    and then stopped answering (SIGSTOP, a wedged process) holds the call until it answers, as
    silence is no sign of that (a ``sleep`` that drains, a ``load``, an update answer only once
    done). Bound what must end: ``timeout``, ``wait(timeout=)``, ``generate(timeout_s=)`` (which
    cancels the job too) or ``asyncio.timeout``.

    ``zero_copy`` picks how arrays come over: ``None`` maps the daemon's shared memory when it is
    on this machine and falls back to the HTTP ``npy`` stream for good the first time it cannot,
    ``False`` always streams, ``True`` raises rather than stream (and connects afresh on the next
    call after one whose connection failed).
    """

    def __init__(
        self, socket_path: str | None = None, timeout: float | None = None, *, zero_copy: bool | None = None
    ) -> None:
        super().__init__(socket_path or default_socket_path(), timeout)  # the pool (connection.py)
        self.zero_copy = zero_copy
        self._arrays = ArrayReader(self, self.job, zero_copy)  # array, trajectory, audio: mapped or over HTTP
        self._background: set[asyncio.Task[Any]] = set()  # cancels on their way out

    async def __aenter__(self) -> AsyncClient:
        self._open()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the pool, after giving the cancels of dropped or interrupted jobs their few seconds."""
        if self._background:
            await asyncio.wait(set(self._background), timeout=CANCEL_GRACE_S)
        await self._close_pool()
        await self._arrays.close()  # last: it may wait for a fetch under way (up to its timeout)

    # jobs ----------------------------------------------------------------------------------
    async def create_job(self, body: dict[str, Any], *, wait_start_s: float = START_WAIT_S,
                         on_wait: Callable[[], None] | None = None, wait_socket_s: float | None = None,
                         on_socket_wait: Callable[[str], None] | None = None,
                         on_posting: Callable[[bool], None] | None = None) -> dict[str, Any]:
        """Submit a job; returns it (``queued``) as soon as the daemon has admitted it.

        So that ``diffusiond serve &`` followed at once by a request works: a socket that is not
        there yet or refuses (not bound yet) is tried again for up to ``wait_socket_s`` seconds
        (None: ``SOCKET_WAIT_S``), ``on_socket_wait`` called once with the reason as that waiting
        begins; then a daemon still loading its models answers 503: the job is offered
        again, every second, for up to ``wait_start_s`` seconds while ``/ready`` says it is starting,
        ``on_wait`` called once as that waiting begins. A daemon that is draining, or that failed to
        start, is an error at once. A NaN or an infinity in ``body`` is a ValueError naming its field,
        before anything is sent. ``on_posting(True)``/``(False)`` bracket each POST: only one in flight
        may have the job admitted with its answer still to come, so an interrupted caller knows whether
        to await that answer (to cancel the job it names) or to stop at once, nothing admitted."""
        check_finite(body, "")

        async def post() -> dict[str, Any]:
            if on_posting is not None:
                on_posting(True)
            try:
                return await self._json("POST", "/v1/jobs", ok=(202,), json=body)
            finally:
                if on_posting is not None:
                    on_posting(False)

        deadline = time.monotonic() + wait_start_s
        socket_s = SOCKET_WAIT_S if wait_socket_s is None else wait_socket_s
        while True:
            try:
                return await until_bound(post, socket_s, on_socket_wait)
            except DaemonError as exc:
                if exc.status != 503 or exc.code != ErrorCode.UNAVAILABLE or time.monotonic() >= deadline:
                    raise
                if not await self._starting():
                    raise
            socket_s = 0.0  # it answered: from here on a socket gone is a daemon gone
            if on_wait is not None:
                on_wait()
                on_wait = None
            await asyncio.sleep(min(1.0, max(0.0, deadline - time.monotonic())))

    async def _starting(self) -> bool:
        async with self._request("GET", "/ready", ok=(200, 503)) as resp:
            body = parse_json(await resp.read(), resp.status)
        return resp.status == 503 and body.get("reason") == "starting"

    async def job(self, job_id: str) -> dict[str, Any]:
        return await self._json("GET", f"/v1/jobs/{quote_id(job_id)}")

    async def events(self, job_id: str) -> AsyncGenerator[tuple[str, dict[str, Any]], None]:
        """The job's events as (name, data) until ``done`` or ``error``.

        A late subscriber gets the current state replayed, so calling this after the job has
        finished still yields its final event. If the daemon closes the stream early the iterator
        just ends; ``job()`` then tells the truth about where the job got to (``wait`` does that).
        """
        parser = SSEParser()
        headers = {"Accept": "text/event-stream"}
        async with self._request("GET", f"/v1/jobs/{quote_id(job_id)}/events", headers=headers) as resp:
            async for chunk in resp.content.iter_any():
                for name, data in parser.feed(chunk):
                    yield name, decode_event(data)
                    if name in TERMINAL_EVENTS:
                        return

    async def wait(
        self, job_id: str, *, timeout: float | None = None, on_event: EventCallback | None = None
    ) -> dict[str, Any]:
        """Follow the job until it ends and return it as the daemon last described it.

        A failed or cancelled job is returned, not raised: look at its ``status`` and ``error``.
        ``on_event`` sees every event on the way (progress, status). ``timeout`` bounds the whole
        wait, a ClientTimeout past it; the job itself goes on (cancel it if it should not).
        """
        try:
            async with asyncio.timeout(timeout):
                for _ in range(_RESUBSCRIBE):
                    async with aclosing(self.events(job_id)) as events:
                        async for name, data in events:
                            if on_event is not None:
                                on_event(name, data)
                            if name in TERMINAL_EVENTS and data.get("status") in TERMINAL_STATUSES:
                                return data
                    job = await self.job(job_id)  # the stream ended early: ask where the job is
                    if job.get("status") in TERMINAL_STATUSES:
                        return job
        except ClientError:
            raise
        except TimeoutError as exc:
            raise ClientTimeout(self.socket_path, f"waiting for job {job_id}", timeout) from exc
        raise DaemonError(0, "stream_ended", f"the daemon kept closing the event stream of job {job_id} early")

    async def output(self, job_id: str, k: int) -> bytes:
        """Output ``k`` in memory; prefer ``stream_output`` for videos and raw arrays."""
        async with self._request("GET", f"/v1/jobs/{quote_id(job_id)}/outputs/{int(k)}") as resp:
            return await resp.read()

    async def stream_output(self, job_id: str, k: int, fileobj: BinaryIO) -> int:
        """Write output ``k`` to ``fileobj`` chunk by chunk; returns the byte count."""
        written = 0
        async with self._request("GET", f"/v1/jobs/{quote_id(job_id)}/outputs/{int(k)}") as resp:
            async for chunk in resp.content.iter_chunked(_CHUNK):
                fileobj.write(chunk)
                written += len(chunk)
        return written

    async def cancel(self, job_id: str) -> dict[str, Any]:
        """Cancel a job; a DaemonError with status 409 if it had already finished (``finished=keep``:
        a cancel that comes too late must not delete the result, which a plain DELETE does)."""
        return await self._json("DELETE", f"/v1/jobs/{quote_id(job_id)}", params={"finished": "keep"})

    async def delete(self, job_id: str) -> dict[str, Any]:
        """Cancel a job that has not finished; delete a finished one with its outputs."""
        return await self._json("DELETE", f"/v1/jobs/{quote_id(job_id)}")

    async def history(self, *, status: str | None = None, model: str | None = None, before: str | None = None,
                      limit: int | None = None) -> dict[str, Any]:
        """A page of jobs, newest first; its ``next_before`` continues it."""
        given = {"status": status, "model": model, "before": before, "limit": limit}
        return await self._json("GET", "/v1/jobs", params={k: str(v) for k, v in given.items() if v is not None})

    # service -------------------------------------------------------------------------------
    async def models(self) -> dict[str, Any]:
        return await self._json("GET", "/v1/models")

    async def load(self, model: str) -> dict[str, Any]:
        """Bring ``model`` onto its device now (making room as the daemon's budget allows); its entry."""
        return await self._json("POST", f"/v1/models/{quote_id(model)}/load")

    async def unload(self, model: str) -> dict[str, Any]:
        """Take ``model`` off its device once its work is done; its entry (``residency`` says where)."""
        return await self._json("POST", f"/v1/models/{quote_id(model)}/unload")

    async def health(self) -> dict[str, Any]:
        """The health report. A degraded daemon may answer 503 with the same body: still returned."""
        async with self._request("GET", "/health", ok=(200, 503)) as resp:
            body = await resp.read()
            report = parse_json(body, resp.status)
            if resp.status == 503 and "error" in report:
                raise error_of(body.decode(errors="replace"), resp)
        return report

    async def ready(self) -> bool:
        """Whether the daemon admits work now (not starting or draining). Not whether its models are loaded
        (issue 27): ``health()["preload"]["state"]`` is ``"done"`` once the start's preload has ended."""
        async with self._request("GET", "/ready", ok=(200, 503)) as resp:
            await resp.read()
            return resp.status == 200

    async def sleep(self, level: int = 1) -> dict[str, Any]:
        """Drain, then free device memory; the daemon keeps its socket and queue. Level 1 moves the
        weights to host memory (a fast wake); level 2 stops the workers, freeing all they held."""
        return await self._json("POST", "/v1/admin/sleep", json={"level": level})

    async def wake(self) -> dict[str, Any]:
        return await self._json("POST", "/v1/admin/wake")

    async def update_lora(self, name: str, state_dict: Mapping[str, Any]) -> int:
        """New weights for live adapter ``name`` (created by the first call), in diffusers/PEFT naming,
        torch tensors or numpy arrays; its new version once every live worker applied them. Through a
        memfd passed by fd, same machine and user only (``client/weights.py``)."""
        from diffusiond.client.weights import update_lora  # numpy: only for callers who use it

        return await _in_daemon_thread(update_lora, self.socket_path, name, state_dict, self.timeout)

    async def update_weights(self, model: str, component: str, state_dict: Mapping[str, Any]) -> int:
        """New values for parameters of one component (``"unet"``, ``"transformer"``...) of ``model``,
        named and shaped as in its ``state_dict``; copied in place between batches; the new version."""
        from diffusiond.client.weights import update_weights

        return await _in_daemon_thread(update_weights, self.socket_path, model, component, state_dict,
                                       self.timeout)

    async def web_url(self) -> str:
        """The web page's sign-in URL (it carries the token); DaemonError 404 ``web_off`` without ``--web``."""
        return str((await self._json("GET", "/v1/admin/web"))["url"])

    # the high-level API -------------------------------------------------------------------
    async def submit(self, prompt: str, **params: Unpack[JobParams]) -> AsyncJobHandle:
        """Submit a job and return its handle at once; dropping the handle unfinished cancels it."""
        return AsyncJobHandle(self, await self.create_job(job_body(prompt, params)))

    @overload
    async def generate(self, prompt: str, *, output: Literal["pil"] = ..., on_event: EventCallback | None = ...,
                       **params: Unpack[JobParams]) -> list[Image.Image]: ...
    @overload
    async def generate(self, prompt: str, *, output: Literal["array"], on_event: EventCallback | None = ...,
                       **params: Unpack[JobParams]) -> list[NDArray[Any]]: ...
    @overload
    async def generate(self, prompt: str, *, output: Literal["bytes"], on_event: EventCallback | None = ...,
                       **params: Unpack[JobParams]) -> list[bytes]: ...  # fmt: skip

    async def generate(
        self, prompt: str, *, output: Output = "pil", on_event: EventCallback | None = None, **params: Unpack[JobParams]
    ) -> list[Any]:
        """Submit, wait, and return the outputs in index order; JobFailed if the job did not succeed.

        ``output="pil"`` asks for PNG unless ``output_format`` says otherwise (so a video model
        needs ``gif``/``webp`` here, or ``output="array"``); ``"array"`` asks for ``npy``, in
        ``output_dtype``; ``"bytes"`` keeps the daemon's default format. With ``timeout_s`` the
        wait is bounded a little past the daemon's own deadline, so the daemon's error, with its
        stage, normally arrives first. An interrupt, or that bound, cancels the job.
        """
        params, asked = params_for(output, params), params
        with pil_needs_a_format(output, asked):
            job = await self.submit(prompt, **params)
        deadline = params.get("timeout_s")
        try:
            final = await job.wait(None if deadline is None else deadline + CANCEL_GRACE_S, on_event=on_event)
        except ClientTimeout:
            await job._cancel_on_the_way_out()
            raise
        except DaemonUnreachable as exc:  # it resumes with the daemon: to wait on, not to submit again
            exc.job_id = job.id
            raise
        return await job._fetch(output, final)

    async def array(self, job_id: str, k: int) -> NDArray[Any]:
        """An npy output: mapped from shared memory where possible, else streamed over HTTP."""
        return await self._arrays.array(job_id, k)

    async def trajectory(self, job_id: str, k: int, *, as_torch: bool = False) -> dict[str, Any]:
        """Output ``k``'s trajectory (a job sent with ``trajectory``): name -> read-only array, mapped from
        the daemon's shared memory where possible (else read over HTTP); ``as_torch``: CPU tensors over
        the same memory (bfloat16 latents come as torch.bfloat16; numpy shows their raw uint16 words)."""
        return await self._arrays.trajectory(job_id, k, as_torch=as_torch)

    async def audio(self, job_id: str, k: int) -> tuple[NDArray[Any], int]:
        """Output ``k``'s sound track (issue 30: a model that makes one, a job not sent with ``"audio": false``)
        and its sample rate: a read-only float32 array ``(channels, samples)`` in [-1, 1], mapped from the
        daemon's shared memory where possible, else read over HTTP (the exact floats, not the WAV's 16 bits)."""
        return await self._arrays.audio(job_id, k)

    def cancel_soon(self, job_id: str) -> asyncio.Task[dict[str, Any] | None]:
        """Start a bounded, quiet cancel that outlives the caller's own cancellation: the task's result is the
        job as cancelled, or as it had ended (``AsyncJobHandle.cancel``), None when the daemon did not say."""
        task = asyncio.ensure_future(self._cancel_quietly(job_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def cancel_from_any_thread(self, job_id: str) -> None:
        """Schedule ``cancel_soon`` on this client's loop from any thread (a dropped handle's
        finalizer runs wherever the GC runs): only while that loop runs and the pool is open."""
        loop = self._loop
        if loop is None or loop.is_closed() or not loop.is_running() or self._session is None:
            return
        try:
            loop.call_soon_threadsafe(self.cancel_soon, job_id)
        except RuntimeError:  # the loop closed in between
            pass

    async def _cancel_quietly(self, job_id: str) -> dict[str, Any] | None:
        try:
            return await asyncio.wait_for(cancel_or_ended(self, job_id), CANCEL_GRACE_S)
        except (ClientError, TimeoutError):  # the daemon is gone, or too slow to say
            return None


async def _in_daemon_thread(call: Callable[..., int], *args: Any) -> int:
    """``call(*args)`` in a thread of its own that the interpreter does not wait for. Not ``asyncio.to_thread``:
    on Ctrl-C ``asyncio.run`` waits for its executor's threads, and an update waiting for the daemon's answer
    (no timeout) held the program's exit for as long as the daemon took, or forever. Sent by then, the update
    completes in the daemon all the same (``weights.py``)."""
    loop = asyncio.get_running_loop()
    answer: asyncio.Future[int] = loop.create_future()

    def settle(value: int | None, exc: BaseException | None) -> None:
        if answer.done():  # cancelled: the caller went
            return
        if exc is not None:
            answer.set_exception(exc)
        else:
            answer.set_result(int(value or 0))

    def run() -> None:
        try:
            value, exc = call(*args), None
        except BaseException as error:  # handed to the awaiting task, raised there
            value, exc = None, error
        try:
            loop.call_soon_threadsafe(settle, value, exc)
        except RuntimeError:  # the loop closed meanwhile: nobody waits for the answer
            pass

    threading.Thread(target=run, name="diffusiond-update", daemon=True).start()
    return await answer
