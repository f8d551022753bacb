"""The client's side of the wire: Server-Sent Events, error bodies, and the small rules of
talking HTTP to the daemon. Kept apart from ``aio.py`` so the client class reads as what it
offers, and so the benchmarks' load generator can parse events without the client."""

from __future__ import annotations

import asyncio
import errno
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar
from urllib.parse import quote

import aiohttp

from diffusiond.client.errors import DaemonError, DaemonUnreachable

SOCKET_WAIT_S = 10.0
"""How long a submit waits for a socket that is not there yet, or refuses: ``diffusiond serve &`` and a
request straight after. The daemon binds its socket once its interpreter has imported
what it serves with: 0.6 to 4 s measured on the 2-core box, under other work. A daemon that never
comes is still reported after this, and the caller's ``on_wait`` says at once what it waits for."""
_SOCKET_POLL_S = 0.1

T = TypeVar("T")


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


def decode_event(data: str) -> dict[str, Any]:
    """Event data as a dict; a non-JSON payload is kept rather than failing the whole stream."""
    try:
        value = json.loads(data)
    except ValueError:
        return {"data": data}
    return value if isinstance(value, dict) else {"data": value}


def quote_id(job_id: str) -> str:
    return quote(str(job_id), safe="")


def parse_json(body: bytes, status: int) -> dict[str, Any]:
    if not body.strip():
        return {}
    try:
        value = json.loads(body)
    except ValueError as exc:
        raise DaemonError(status, "bad_response", f"the daemon answered non-JSON: {body[:200]!r}") from exc
    return value if isinstance(value, dict) else {"data": value}


def reason(exc: BaseException) -> str:
    """The most specific cause: 'No such file or directory' beats aiohttp's wrapper text."""
    os_error = getattr(exc, "os_error", None)
    if isinstance(os_error, OSError) and os_error.strerror:
        return os_error.strerror
    return str(exc) or type(exc).__name__


async def error_from(resp: aiohttp.ClientResponse) -> DaemonError:
    """The response's body as a DaemonError (``error_of``)."""
    return error_of(await resp.text(errors="replace"), resp)


def error_of(text: str, resp: aiohttp.ClientResponse) -> DaemonError:
    """An error body already read (``health`` reads its body before it knows it is one) as a DaemonError: the
    daemon's ``{"error": {...}}``; anything else (a proxy's page, a truncated body) still gets a message."""
    try:
        err = json.loads(text)["error"]
        field, stage = err.get("field"), err.get("stage")
        return DaemonError(
            resp.status,
            str(err.get("code") or f"http_{resp.status}"),
            str(err.get("message") or resp.reason or ""),
            None if field is None else str(field),
            None if stage is None else str(stage),
            retry_after(resp),
        )
    except (ValueError, KeyError, TypeError, AttributeError):
        message = text.strip()[:200] or resp.reason or "error"
        return DaemonError(resp.status, f"http_{resp.status}", message, retry_after=retry_after(resp))


def retry_after(resp: aiohttp.ClientResponse) -> float | None:
    retry = resp.headers.get("Retry-After")
    return float(retry) if retry and retry.replace(".", "", 1).isdigit() else None


async def until_bound(request: Callable[[], Awaitable[T]], seconds: float,
                         on_wait: Callable[[str], None] | None = None) -> T:
    """``request()``, tried again for up to ``seconds`` while the socket is not bound yet (``not_bound_yet``),
    ``on_wait`` called once with the reason as the waiting begins; past it, DaemonUnreachable saying how
    long it waited."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return await request()
        except DaemonUnreachable as exc:
            if not not_bound_yet(exc) or seconds <= 0:
                raise
            if time.monotonic() >= deadline:
                raise DaemonUnreachable(exc.socket_path, f"{exc.reason}, still after {seconds:g} s") from exc
            if on_wait is not None:
                on_wait(exc.reason)
                on_wait = None
        await asyncio.sleep(_SOCKET_POLL_S)


def not_bound_yet(exc: DaemonUnreachable) -> bool:
    """Whether connecting found no socket file (ENOENT) or one nothing listens on (ECONNREFUSED, a stale
    file a starting daemon replaces): what a daemon started a moment ago looks like. A path that is no
    socket, or a connection lost midway, is not that."""
    os_error = getattr(exc.__cause__, "os_error", None)
    return (not exc.not_a_socket and isinstance(os_error, OSError)
            and os_error.errno in (errno.ENOENT, errno.ECONNREFUSED))
