"""An async client for a running diffusiond, over its Unix socket.

The CLI is a thin shell over this module, and Python users (a training loop, a notebook) can use it
directly instead of hand-writing HTTP: it knows the socket-path rules, turns the daemon's JSON errors
into exceptions, follows a job's Server-Sent Events, and streams outputs to files without holding a
whole video in memory.

Every failure a caller can meet comes out as one of these, so ``except ClientError`` is enough to
keep aiohttp's and asyncio's own exceptions out of a caller's code:

    ClientError
    ├── DaemonUnreachable    nothing answers on the socket, or the connection died mid-answer
    ├── DaemonError          the daemon answered with an error: status, code, message, field,
    │                        stage, retry_after (HTTP 4xx/5xx, or an answer that made no sense)
    └── ClientTimeout        a request, or a wait for a job, took longer than the caller allowed
                             (also a ``TimeoutError``, which is what such code caught before)

A job that fails or is cancelled is not an exception: ``wait`` returns the job, whose ``status``
and ``error`` say what happened. Writing an output to a file can still raise ``OSError``; that
is the caller's file, not the daemon.

It depends on nothing of the daemon (the socket-path rules are in ``diffusiond.protocol``), so
importing it never pulls in torch, the engine, or the encoders.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from types import TracebackType
from typing import Any, BinaryIO
from urllib.parse import quote

import aiohttp

from diffusiond.protocol import TERMINAL_EVENTS, TERMINAL_STATUSES, default_socket_path

__all__ = [
    "BASE_URL", "Client", "ClientError", "ClientTimeout", "DaemonError", "DaemonUnreachable", "SSEParser",
    "default_socket_path",
]  # fmt: skip

BASE_URL = "http://diffusiond"
"""The host part is ignored on a Unix socket; a fixed name keeps URLs readable in logs."""

_CHUNK = 256 * 1024
_CONNECT_TIMEOUT_S = 30.0
_RESUBSCRIBE = 3
"""How often ``wait`` re-opens an event stream the daemon closed before the job ended."""

EventCallback = Callable[[str, dict[str, Any]], None]


class ClientError(Exception):
    """The root of every exception this module raises; see the tree in the module docstring."""


class DaemonError(ClientError):
    """The daemon answered, and the answer was an error (a rejected request, an unknown job, ...).

    One type for every HTTP error, carrying the daemon's own code and message, so callers can
    branch on ``status``/``code`` and show ``str(exc)`` to a person as it is. ``status`` is 0
    for errors found on this side (an event stream that kept ending early).
    """

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        field: str | None = None,
        stage: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        self.status = status
        self.code = code
        self.message = message
        self.field = field
        self.stage = stage
        self.retry_after = retry_after
        super().__init__(status, code, message, field, stage)

    def __str__(self) -> str:
        details = [self.code, f"HTTP {self.status}"]
        if self.field:
            details.append(f"field {self.field}")
        if self.stage:
            details.append(f"stage {self.stage}")
        if self.retry_after is not None:
            details.append(f"retry after {self.retry_after:g} s")
        return f"{self.message} ({', '.join(details)})"


class DaemonUnreachable(ClientError):
    """Nothing answers on the socket (missing, refused, or the connection died).

    The message names the path tried and how to start a daemon, because the usual cause is simply
    that none is running, or that client and daemon disagree about the path.
    """

    def __init__(self, socket_path: str, reason: str) -> None:
        self.socket_path = socket_path
        self.reason = reason
        super().__init__(socket_path, reason)

    def __str__(self) -> str:
        return (
            f"no diffusiond reachable at {self.socket_path} ({self.reason}).\n"
            f"Start one with `diffusiond serve --socket {self.socket_path}` or "
            "`systemctl --user start diffusiond.socket`,\n"
            "or point the client at a running daemon with --socket PATH or $DIFFUSIOND_SOCKET."
        )


class ClientTimeout(ClientError, TimeoutError):
    """A request or a wait took longer than the caller allowed.

    Kept apart from DaemonUnreachable: the daemon may well be alive and busy (a long sleep, a
    queue full of work), and the job behind a timed-out wait is still there, so the message
    says what timed out and after how long rather than suggesting the daemon is gone.
    """

    def __init__(self, socket_path: str, what: str, seconds: float | None) -> None:
        self.socket_path = socket_path
        self.what = what
        self.seconds = seconds
        super().__init__(socket_path, what, seconds)

    def __str__(self) -> str:
        limit = f"longer than {self.seconds:g} s" if self.seconds is not None else "too long"
        return f"{self.what} (daemon at {self.socket_path}) took {limit}"


class SSEParser:
    """An incremental Server-Sent Events parser: feed it bytes as they arrive, get whole events.

    Chunk boundaries from the network fall anywhere (inside a line, between CR and LF, inside a
    UTF-8 character), so bytes are buffered until a line is complete and decoded per line. Follows
    the WHATWG rules that matter here: CR, LF or CRLF end a line; ``:`` lines are comments; several
    ``data:`` lines join with newlines; an event with no data is not dispatched.
    """

    def __init__(self) -> None:
        self._buf = b""
        self._event = ""
        self._data: list[str] = []
        self._first = True

    def feed(self, chunk: bytes) -> list[tuple[str, str]]:
        """Events completed by ``chunk``, as (name, data) with name defaulting to ``message``."""
        self._buf += chunk
        out: list[tuple[str, str]] = []
        while True:
            line = self._next_line()
            if line is None:
                return out
            event = self._line(line)
            if event is not None:
                out.append(event)

    def _next_line(self) -> str | None:
        buf = self._buf
        cr, lf = buf.find(b"\r"), buf.find(b"\n")
        if cr < 0 and lf < 0:
            return None
        if cr >= 0 and (lf < 0 or cr < lf):
            if cr + 1 == len(buf):
                return None  # a CR at the end may be the first half of CRLF: wait for more
            end, skip = cr, 2 if buf[cr + 1 : cr + 2] == b"\n" else 1
        else:
            end, skip = lf, 1
        raw, self._buf = buf[:end], buf[end + skip :]
        if self._first:
            self._first = False
            raw = raw.removeprefix(b"\xef\xbb\xbf")
        return raw.decode("utf-8", errors="replace")

    def _line(self, line: str) -> tuple[str, str] | None:
        if not line:
            event, data = self._event or "message", self._data
            self._event, self._data = "", []
            return (event, "\n".join(data)) if data else None
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "event":
            self._event = value
        elif name == "data":
            self._data.append(value)
        return None  # id and retry mean nothing to a client that does not reconnect


def _decode(data: str) -> dict[str, Any]:
    """Event data as a dict; a non-JSON payload is kept rather than failing the whole stream."""
    try:
        value = json.loads(data)
    except ValueError:
        return {"data": data}
    return value if isinstance(value, dict) else {"data": value}


class Client:
    """One connection pool to one daemon. Use ``async with Client() as c:`` or call ``close()``.

    ``timeout`` bounds every request, an event stream included, so leave it ``None`` when
    following jobs that may run long (``wait`` takes its own bound); connecting is bounded
    either way.
    """

    def __init__(self, socket_path: str | None = None, timeout: float | None = None) -> None:
        self.socket_path = socket_path or default_socket_path()
        self.timeout = timeout
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Client:
        self._open()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()

    def _open(self) -> aiohttp.ClientSession:
        # Created lazily, inside the running loop: aiohttp binds a session to the loop it starts on.
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path=self.socket_path),
                timeout=aiohttp.ClientTimeout(total=self.timeout, sock_connect=self._connect_s()),
            )
        return self._session

    # plumbing --------------------------------------------------------------------------------
    @asynccontextmanager
    async def _request(
        self, method: str, path: str, *, ok: tuple[int, ...] = (200,), **kwargs: Any
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """A response whose status is in ``ok``; any other status becomes a DaemonError.

        aiohttp's and asyncio's exceptions, raised before the answer or while its body is read
        inside the ``async with``, become this module's own (see the tree at the top).
        """
        session = self._open()
        try:
            async with session.request(method, BASE_URL + path, **kwargs) as resp:
                if resp.status not in ok:
                    raise await _error_from(resp)
                yield resp
        except ClientError:
            raise
        except aiohttp.ConnectionTimeoutError as exc:  # the socket is there; its backlog did not move
            raise ClientTimeout(self.socket_path, f"connecting for {method} {path}", self._connect_s()) from exc
        except aiohttp.ClientConnectorError as exc:
            raise DaemonUnreachable(self.socket_path, _reason(exc)) from exc
        except TimeoutError as exc:  # aiohttp's timeouts are also connection errors: the clearer of the two
            raise ClientTimeout(self.socket_path, f"{method} {path}", self.timeout) from exc
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
            raise DaemonUnreachable(self.socket_path, f"connection lost: {_reason(exc)}") from exc
        except aiohttp.ClientError as exc:  # something answered, but not in HTTP that makes sense
            raise DaemonUnreachable(self.socket_path, f"not a diffusiond answer: {_reason(exc)}") from exc

    def _connect_s(self) -> float:
        return _CONNECT_TIMEOUT_S if self.timeout is None else min(self.timeout, _CONNECT_TIMEOUT_S)

    async def _json(self, method: str, path: str, *, ok: tuple[int, ...] = (200,), **kwargs: Any) -> dict[str, Any]:
        async with self._request(method, path, ok=ok, **kwargs) as resp:
            return _parse_json(await resp.read(), resp.status)

    # jobs ----------------------------------------------------------------------------------
    async def create_job(self, body: dict[str, Any]) -> dict[str, Any]:
        """Submit a job; returns it (``queued``) as soon as the daemon has admitted it."""
        return await self._json("POST", "/v1/jobs", ok=(202,), json=body)

    async def job(self, job_id: str) -> dict[str, Any]:
        return await self._json("GET", f"/v1/jobs/{_q(job_id)}")

    async def events(self, job_id: str) -> AsyncGenerator[tuple[str, dict[str, Any]], None]:
        """The job's events as (name, data) until ``done`` or ``error``.

        A late subscriber gets the current state replayed, so calling this after the job has
        finished still yields its final event. If the daemon closes the stream early the iterator
        just ends; ``job()`` then tells the truth about where the job got to (``wait`` does that).
        """
        parser = SSEParser()
        headers = {"Accept": "text/event-stream"}
        async with self._request("GET", f"/v1/jobs/{_q(job_id)}/events", headers=headers) as resp:
            async for chunk in resp.content.iter_any():
                for name, data in parser.feed(chunk):
                    yield name, _decode(data)
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
        async with self._request("GET", f"/v1/jobs/{_q(job_id)}/outputs/{int(k)}") as resp:
            return await resp.read()

    async def stream_output(self, job_id: str, k: int, fileobj: BinaryIO) -> int:
        """Write output ``k`` to ``fileobj`` chunk by chunk; returns the byte count."""
        written = 0
        async with self._request("GET", f"/v1/jobs/{_q(job_id)}/outputs/{int(k)}") as resp:
            async for chunk in resp.content.iter_chunked(_CHUNK):
                fileobj.write(chunk)
                written += len(chunk)
        return written

    async def cancel(self, job_id: str) -> dict[str, Any]:
        """Cancel a job; a DaemonError with status 409 if it had already finished."""
        return await self._json("DELETE", f"/v1/jobs/{_q(job_id)}")

    # service -------------------------------------------------------------------------------
    async def models(self) -> dict[str, Any]:
        return await self._json("GET", "/v1/models")

    async def health(self) -> dict[str, Any]:
        """The health report. A degraded daemon may answer 503 with the same body: still returned."""
        async with self._request("GET", "/health", ok=(200, 503)) as resp:
            body = await resp.read()
            report = _parse_json(body, resp.status)
            if resp.status == 503 and "error" in report:
                raise _error_of(report, resp)
        return report

    async def ready(self) -> bool:
        """Whether the daemon admits work now (models loaded, not draining or asleep)."""
        async with self._request("GET", "/ready", ok=(200, 503)) as resp:
            await resp.read()
            return resp.status == 200

    async def sleep(self) -> dict[str, Any]:
        """Drain, then free device memory; the daemon keeps its socket and queue."""
        return await self._json("POST", "/v1/admin/sleep")

    async def wake(self) -> dict[str, Any]:
        return await self._json("POST", "/v1/admin/wake")


def _q(job_id: str) -> str:
    return quote(str(job_id), safe="")


def _parse_json(body: bytes, status: int) -> dict[str, Any]:
    if not body.strip():
        return {}
    try:
        value = json.loads(body)
    except ValueError as exc:
        raise DaemonError(status, "bad_response", f"the daemon answered non-JSON: {body[:200]!r}") from exc
    return value if isinstance(value, dict) else {"data": value}


def _reason(exc: BaseException) -> str:
    """The most specific cause: 'No such file or directory' beats aiohttp's wrapper text."""
    os_error = getattr(exc, "os_error", None)
    if isinstance(os_error, OSError) and os_error.strerror:
        return os_error.strerror
    return str(exc) or type(exc).__name__


async def _error_from(resp: aiohttp.ClientResponse) -> DaemonError:
    """The daemon's ``{"error": {...}}`` body as a DaemonError; anything else still gets a message."""
    text = await resp.text(errors="replace")
    try:
        return _error_of(json.loads(text), resp)
    except (ValueError, KeyError, TypeError, AttributeError):
        message = text.strip()[:200] or resp.reason or "error"
        return DaemonError(resp.status, f"http_{resp.status}", message, retry_after=_retry_after(resp))


def _error_of(body: Any, resp: aiohttp.ClientResponse) -> DaemonError:
    """An error document already read (``health`` reads its body before it knows) as a DaemonError;
    KeyError and friends when the body is not one."""
    err = body["error"]
    field, stage = err.get("field"), err.get("stage")
    return DaemonError(
        resp.status,
        str(err.get("code") or f"http_{resp.status}"),
        str(err.get("message") or resp.reason or ""),
        None if field is None else str(field),
        None if stage is None else str(stage),
        _retry_after(resp),
    )


def _retry_after(resp: aiohttp.ClientResponse) -> float | None:
    retry = resp.headers.get("Retry-After")
    return float(retry) if retry and retry.replace(".", "", 1).isdigit() else None
