"""The blocking client: ``with diffusiond.Client() as c: images = c.generate("a cat")``.

A thin shell over ``AsyncClient`` rather than a second implementation: it runs one on a private
event loop in a background thread, so the two cannot drift apart, event iteration and a dropped
handle's cancel work the same way, and a caller's Ctrl-C can reach the job (the interrupt lands
in the calling thread, which cancels the coroutine on the loop, which cancels the job).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import signal
import threading
import time
import weakref
from collections.abc import Callable, Coroutine, Iterator, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, TypeVar, Unpack, overload

from diffusiond.client.aio import START_WAIT_S, AsyncClient, EventCallback
from diffusiond.client.errors import ClientError
from diffusiond.client.handle import CANCEL_GRACE_S, AsyncJobHandle
from diffusiond.client.params import JobParams, Output

if TYPE_CHECKING:
    from numpy.typing import NDArray
    from PIL import Image

__all__ = ["Client", "JobHandle"]

T = TypeVar("T")
_tasks: set[asyncio.Future[Any]] = set()  # a loop holds its tasks only weakly


def _keep(task: asyncio.Future[Any]) -> None:
    _tasks.add(task)
    task.add_done_callback(_tasks.discard)


class Client:
    """One daemon, one connection pool, one background thread. Use ``with Client() as c:`` or
    call ``close()``; the parameters are ``AsyncClient``'s (whose docstring says what ``timeout=None`` leaves
    unbounded: a daemon that stopped answering holds a call until it answers). Safe to share between threads."""

    def __init__(
        self, socket_path: str | None = None, timeout: float | None = None, *, zero_copy: bool | None = None
    ) -> None:
        self._async = AsyncClient(socket_path, timeout, zero_copy=zero_copy)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=_serve, args=(self._loop,), name="diffusiond-client", daemon=True)
        self._thread.start()
        self._closed = False
        # The calls under way in other threads: close() ends them before it stops the loop,
        # and the lock keeps a call from being scheduled onto a loop that close() is stopping.
        self._lock = threading.Lock()
        self._in_flight: set[tuple[concurrent.futures.Future[Any], threading.Event]] = set()
        # A client dropped without close() still ends its thread (without waiting on the GC's thread).
        self._finalizer = weakref.finalize(self, _stop_soon, self._loop, self._async)

    @property
    def socket_path(self) -> str:
        return self._async.socket_path

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """End the calls other threads still wait on (each gets a ClientError; a ``JobHandle`` wait
        cancels its job, as an interrupt does), close the pool after the cancels under way, and end
        the background thread. Every step is bounded: close never hangs on a daemon that is gone."""
        if threading.current_thread() is self._thread:
            raise ClientError("a Client closed from its own thread (an on_event callback): close it elsewhere")
        with self._lock:
            if self._closed:
                return
            self._closed = True
            calls = list(self._in_flight)
        try:
            # Before the pool closes and the loop stops: a wait left suspended there would
            # get a raw RuntimeError from shutdown_asyncgens, or never be answered at all.
            for future, _ in calls:
                future.cancel()
            deadline = time.monotonic() + CANCEL_GRACE_S + 1
            for _, finished in calls:
                finished.wait(max(0.0, deadline - time.monotonic()))
            closing = asyncio.run_coroutine_threadsafe(self._async.close(), self._loop)
            try:
                closing.result(CANCEL_GRACE_S + 1)
            except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
                closing.cancel()
        finally:
            self._finalizer.detach()
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(CANCEL_GRACE_S * 2)

    def _call(self, work: Coroutine[Any, Any, T]) -> T:
        """Run ``work`` on the loop and wait for it. On KeyboardInterrupt the coroutine is
        cancelled (so a job it waits on is cancelled too) and given a few seconds to do so.
        A ``close()`` from another thread meanwhile ends the wait with a ClientError."""
        if threading.current_thread() is self._thread:
            work.close()
            # From the client's own thread (an on_event callback) the wait could never end.
            raise ClientError("a Client called from its own thread")
        finished = threading.Event()

        async def run() -> T:
            try:
                return await work
            finally:
                finished.set()

        with self._lock:
            if self._closed:
                work.close()
                raise ClientError("the client is closed")
            future = asyncio.run_coroutine_threadsafe(run(), self._loop)
            call = (future, finished)
            self._in_flight.add(call)
        try:
            return future.result()
        except KeyboardInterrupt:
            future.cancel()
            finished.wait(CANCEL_GRACE_S + 1)
            raise
        except (concurrent.futures.CancelledError, asyncio.CancelledError, RuntimeError) as exc:
            if not self._closed:
                raise
            raise ClientError("the client was closed while this call waited") from exc
        finally:
            with self._lock:
                self._in_flight.discard(call)

    # the high-level API -------------------------------------------------------------------
    def submit(self, prompt: str, **params: Unpack[JobParams]) -> JobHandle:
        """Submit a job and return its handle at once; dropping the handle unfinished cancels it."""
        return JobHandle(self, self._call(self._async.submit(prompt, **params)))

    @overload
    def generate(self, prompt: str, *, output: Literal["pil"] = ..., on_event: EventCallback | None = ...,
                 **params: Unpack[JobParams]) -> list[Image.Image]: ...
    @overload
    def generate(self, prompt: str, *, output: Literal["array"], on_event: EventCallback | None = ...,
                 **params: Unpack[JobParams]) -> list[NDArray[Any]]: ...
    @overload
    def generate(self, prompt: str, *, output: Literal["bytes"], on_event: EventCallback | None = ...,
                 **params: Unpack[JobParams]) -> list[bytes]: ...  # fmt: skip

    def generate(
        self, prompt: str, *, output: Output = "pil", on_event: EventCallback | None = None, **params: Unpack[JobParams]
    ) -> list[Any]:
        """``AsyncClient.generate``, blocking: JobFailed if the job fails; Ctrl-C cancels it.
        ``on_event`` runs on the client's thread: keep it short."""
        return self._call(self._async.generate(prompt, output=output, on_event=on_event, **params))

    # the job API and the service ----------------------------------------------------------
    def create_job(self, body: dict[str, Any], *, wait_start_s: float = START_WAIT_S,
                   on_wait: Callable[[], None] | None = None, wait_socket_s: float | None = None,
                   on_socket_wait: Callable[[str], None] | None = None,
                   on_posting: Callable[[bool], None] | None = None) -> dict[str, Any]:
        """``AsyncClient.create_job``, blocking, with its keywords (a sync caller could not shorten
        the wait for a starting daemon); ``on_wait``, ``on_socket_wait`` and ``on_posting`` run on the client's
        thread."""
        return self._call(self._async.create_job(body, wait_start_s=wait_start_s, on_wait=on_wait,
                                                 wait_socket_s=wait_socket_s, on_socket_wait=on_socket_wait,
                                                 on_posting=on_posting))

    def job(self, job_id: str) -> dict[str, Any]:
        return self._call(self._async.job(job_id))

    def cancel(self, job_id: str) -> dict[str, Any]:
        """Cancel a job; a DaemonError with status 409 if it had already finished."""
        return self._call(self._async.cancel(job_id))

    def output(self, job_id: str, k: int) -> bytes:
        return self._call(self._async.output(job_id, k))

    def trajectory(self, job_id: str, k: int, *, as_torch: bool = False) -> dict[str, Any]:
        """Output ``k``'s trajectory (``AsyncClient.trajectory``): name -> read-only array over shared memory."""
        return self._call(self._async.trajectory(job_id, k, as_torch=as_torch))

    def audio(self, job_id: str, k: int) -> tuple[NDArray[Any], int]:
        """Output ``k``'s sound track and its sample rate (``AsyncClient.audio``)."""
        return self._call(self._async.audio(job_id, k))

    def models(self) -> dict[str, Any]:
        return self._call(self._async.models())

    def health(self) -> dict[str, Any]:
        return self._call(self._async.health())

    def ready(self) -> bool:
        return self._call(self._async.ready())

    def load(self, model: str) -> dict[str, Any]:
        return self._call(self._async.load(model))

    def unload(self, model: str) -> dict[str, Any]:
        return self._call(self._async.unload(model))

    def sleep(self, level: int = 1) -> dict[str, Any]:
        return self._call(self._async.sleep(level))

    def wake(self) -> dict[str, Any]:
        return self._call(self._async.wake())

    def update_lora(self, name: str, state_dict: Mapping[str, Any]) -> int:
        """``AsyncClient.update_lora``, in the calling thread (it needs no event loop)."""
        from diffusiond.client.weights import update_lora

        return update_lora(self.socket_path, name, state_dict, self._async.timeout)

    def update_weights(self, model: str, component: str, state_dict: Mapping[str, Any]) -> int:
        """``AsyncClient.update_weights``, in the calling thread."""
        from diffusiond.client.weights import update_weights

        return update_weights(self.socket_path, model, component, state_dict, self._async.timeout)

    def web_url(self) -> str:
        return self._call(self._async.web_url())


class JobHandle:
    """``AsyncJobHandle``, blocking. Dropping it unfinished cancels the job, on the client's
    thread: the garbage collector never waits on the daemon."""

    def __init__(self, client: Client, handle: AsyncJobHandle) -> None:
        self.client = client
        self._handle = handle  # the only reference: when this handle goes, its finalizer cancels
        self.id = handle.id

    def __repr__(self) -> str:
        return f"<JobHandle {self.id} {self.job.get('status')}>"

    @property
    def job(self) -> dict[str, Any]:
        """The job as last seen (``refresh`` asks the daemon)."""
        return self._handle.job

    @property
    def finished(self) -> bool:
        return self._handle.finished

    def refresh(self) -> dict[str, Any]:
        return self.client._call(self._handle.refresh())

    def events(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """(name, data) events until ``done`` or ``error``; leaving the loop early closes the stream."""
        events = self._handle.events()

        async def step() -> tuple[str, dict[str, Any]] | None:
            try:
                return await anext(events)
            except StopAsyncIteration:
                return None

        try:
            while (event := self.client._call(step())) is not None:
                yield event
        finally:  # maybe run by the GC, maybe on the client's thread: do not wait there
            if threading.current_thread() is self.client._thread:
                _keep(asyncio.ensure_future(events.aclose()))
            elif not self.client._closed:
                self.client._call(events.aclose())

    def wait(self, timeout: float | None = None, *, on_event: EventCallback | None = None) -> dict[str, Any]:
        """The final job, failed or cancelled ones included (look at ``status``); ClientTimeout
        after ``timeout`` leaves the job running; Ctrl-C cancels it."""
        return self.client._call(self._handle.wait(timeout, on_event=on_event))

    def cancel(self) -> dict[str, Any]:
        """Cancel the job and return it; a job that had already finished is returned as it ended."""
        return self.client._call(self._handle.cancel())

    @overload
    def outputs(self, output: Literal["pil"] = ...) -> list[Image.Image]: ...
    @overload
    def outputs(self, output: Literal["array"]) -> list[NDArray[Any]]: ...
    @overload
    def outputs(self, output: Literal["bytes"]) -> list[bytes]: ...

    def outputs(self, output: Output = "pil") -> list[Any]:
        """Waits for the end, then every output in index order; JobFailed unless it succeeded."""
        return self.client._call(self._handle.outputs(output))

    def trajectory(self, k: int = 0, *, as_torch: bool = False) -> dict[str, Any]:
        """Waits for the end, then output ``k``'s trajectory: name -> read-only array (``as_torch``: tensors)."""
        return self.client._call(self._handle.trajectory(k, as_torch=as_torch))

    def audio(self, k: int = 0) -> tuple[NDArray[Any], int]:
        """Waits for the end, then output ``k``'s sound track: a read-only float32 (channels, samples) array and
        its rate."""
        return self.client._call(self._handle.audio(k))


def _serve(loop: asyncio.AbstractEventLoop) -> None:
    # Ctrl-C must land in the caller's thread, which is the one waiting and able to cancel: a
    # SIGINT taken by this thread would only set a flag that the blocked caller never sees.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
    finally:
        try:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            loop.close()


def _stop_soon(loop: asyncio.AbstractEventLoop, client: AsyncClient) -> None:
    """The finalizer of a Client never closed: close its pool and stop its loop, without waiting."""

    async def stop() -> None:
        try:
            await client.close()
        finally:
            loop.stop()

    if not loop.is_closed():
        try:
            loop.call_soon_threadsafe(lambda: _keep(loop.create_task(stop())))
        except RuntimeError:  # closed in between
            pass
