"""The client's side of the wire: Server-Sent Events, error bodies, and the small rules of
talking HTTP to the daemon. Kept apart from ``aio.py`` so the client class reads as what it
offers, and so the benchmarks' load generator can parse events without the client."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote

import aiohttp

from diffusiond.client.errors import DaemonError


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
    """The daemon's ``{"error": {...}}`` body as a DaemonError; anything else still gets a message."""
    text = await resp.text(errors="replace")
    try:
        return error_of(json.loads(text), resp)
    except (ValueError, KeyError, TypeError, AttributeError):
        message = text.strip()[:200] or resp.reason or "error"
        return DaemonError(resp.status, f"http_{resp.status}", message, retry_after=retry_after(resp))


def error_of(body: Any, resp: aiohttp.ClientResponse) -> DaemonError:
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
        retry_after(resp),
    )


def retry_after(resp: aiohttp.ClientResponse) -> float | None:
    retry = resp.headers.get("Retry-After")
    return float(retry) if retry and retry.replace(".", "", 1).isdigit() else None
