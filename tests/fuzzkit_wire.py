"""The fuzzing kit's wire and oracle (part of tests/fuzzkit.py): a request as bytes (``Req``), an
answer (``Answer``), the raw HTTP/1.1 sender to the Unix socket or the ``--web`` listener, and
``problems``/``check``, the one oracle every answer is held to.

Apart from the families because it knows nothing of what is worth sending: every family module
builds its ``Req`` here, and tests/test_fuzz_surfaces.py and scripts/fuzz.py send and judge through
it. tests/fuzzkit.py says why requests go as raw bytes and what the oracle demands.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
from dataclasses import dataclass, field
from typing import Any

TIMEOUT_S = 60.0
SYNC_PATHS = ("/v1/images/generations", "/v1/images/edits")
ERROR_KEYS = {"code", "message", "field", "stage"}
# 503 is documented for a daemon that is starting, draining or has no worker; nothing else
DOCUMENTED_503 = {"starting", "shutting_down", "draining", "no_worker", "unavailable", "worker_unavailable"}


# requests and answers --------------------------------------------------------------------------
@dataclass(frozen=True)
class Target:
    """Where the daemon listens. ``web_port`` is its ``--web`` listener on 127.0.0.1 (None: none)."""

    socket: str
    web_port: int | None = None
    token: str | None = None


@dataclass
class Req:
    """One request as bytes on the wire. ``auth``: on the web listener, add the bearer token
    unless the request carries its own credentials. ``must``: the statuses this input may get
    (an access rule: a foreign Origin is 403 whatever else holds), None for any non-5xx.
    ``parser``: the request breaks HTTP itself, so aiohttp's parser may refuse it with its own
    plain-text 400 before the application sees it."""

    surface: str
    listener: str  # "unix" or "web"
    method: str
    path: bytes
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    auth: bool = True
    host: bytes | None = None
    must: frozenset[int] | None = None
    parser: bool = False
    note: str = ""

    def describe(self, limit: int = 400) -> str:
        body = self.body if len(self.body) <= limit else self.body[:limit] + b"...(%d bytes)" % len(self.body)
        heads = [(k, v if len(v) <= limit else v[:limit] + b"...") for k, v in self.headers]
        return (f"[{self.surface}] {self.listener} {self.method} {self.path[:limit]!r} headers={heads!r} "
                f"body={body!r}{' ' + self.note if self.note else ''}")


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes
    elapsed_s: float = 0.0

    def json(self) -> Any:
        return json.loads(self.body)


def _wire(target: Target, req: Req) -> bytes:
    names = {k.lower() for k, _ in req.headers}
    lines = [req.method.encode() + b" " + req.path + b" HTTP/1.1"]
    if req.host is not None:
        lines.append(b"Host: " + req.host)
    elif b"host" not in names:
        lines.append(b"Host: " + (f"127.0.0.1:{target.web_port}".encode() if req.listener == "web" else b"diffusiond"))
    if (req.listener == "web" and req.auth and target.token and b"authorization" not in names
            and b"cookie" not in names):
        lines.append(b"Authorization: Bearer " + target.token.encode())
    for name, value in req.headers:
        lines.append(name + b": " + value)
    if b"content-length" not in names and b"transfer-encoding" not in names:
        lines.append(b"Content-Length: %d" % len(req.body))
    lines.append(b"Connection: close")
    return b"\r\n".join(lines) + b"\r\n\r\n" + req.body


def connect(target: Target, listener: str, timeout: float) -> socket.socket:
    if listener == "web":
        if target.web_port is None:
            raise ValueError("this daemon has no web listener")
        sock = socket.create_connection(("127.0.0.1", target.web_port), timeout=timeout)
    else:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        sock.connect(target.socket)
    return sock


def send(target: Target, req: Req, timeout: float = TIMEOUT_S) -> Answer:
    """Send ``req`` on its own connection and read the whole answer (an event stream too: the
    fuzzed jobs are finished or unknown, so their streams end)."""
    t0 = time.monotonic()
    sock = connect(target, req.listener, timeout)
    try:
        try:
            sock.sendall(_wire(target, req))
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered early and closed (a body over the limit): read that answer
        resp = http.client.HTTPResponse(sock, method=req.method)
        resp.begin()
        try:
            body = resp.read()
        except http.client.IncompleteRead as exc:
            body = exc.partial
        return Answer(resp.status, {k.lower(): v for k, v in resp.getheaders()}, body, time.monotonic() - t0)
    finally:
        sock.close()


def request(target: Target, method: str, path: str, body: Any = None, listener: str = "unix") -> Answer:
    """A plain JSON request, for set-up and checks."""
    data = b"" if body is None else json.dumps(body).encode()
    headers = [(b"Content-Type", b"application/json")] if body is not None else []
    return send(target, Req("setup", listener, method, path.encode(), headers, data))


def health_problem(target: Target) -> str | None:
    """None while the daemon answers ``/health`` with ``ok`` (its event loop and every worker)."""
    try:
        ans = request(target, "GET", "/health")
        if ans.status == 200 and ans.json().get("status") == "ok":
            return None
        return f"/health answered {ans.status} {ans.body[:300]!r}"
    except (OSError, http.client.HTTPException, ValueError) as exc:
        return f"/health did not answer: {exc!r}"


# the oracle ------------------------------------------------------------------------------------
def error_shape_problem(ans: Answer) -> str | None:
    ctype = ans.headers.get("content-type", "")
    if not ctype.startswith("application/json"):
        return f"a {ans.status} with Content-Type {ctype!r}, not application/json"
    try:
        doc = json.loads(ans.body)
    except ValueError:
        return f"a {ans.status} whose body is not JSON"
    if not isinstance(doc, dict) or set(doc) != {"error"} or not isinstance(doc["error"], dict):
        return f"a {ans.status} whose body is not {{\"error\": {{...}}}}"
    err = doc["error"]
    if not (isinstance(err.get("code"), str) and err["code"] and isinstance(err.get("message"), str)
            and err["message"]):
        return f"a {ans.status} whose error lacks a code or a message"
    if not set(err) <= ERROR_KEYS:
        return f"a {ans.status} whose error has keys {sorted(set(err) - ERROR_KEYS)} beyond the documented ones"
    if err.get("field") is not None and not isinstance(err["field"], str):
        return f"a {ans.status} whose error field is not a string"
    return None


def _code(ans: Answer) -> str | None:
    try:
        return str(json.loads(ans.body)["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return None


def problems(req: Req, ans: Answer) -> list[str]:
    """What is wrong with ``ans`` as the answer to ``req``; empty when it is a deliberate answer."""
    out: list[str] = []
    path = req.path.split(b"?", 1)[0].decode(errors="replace")
    if ans.status >= 500:
        documented = ((ans.status == 503 and _code(ans) in DOCUMENTED_503)
                      or (ans.status == 504 and path in SYNC_PATHS and _code(ans) == "deadline_exceeded"))
        if not documented:
            out.append(f"answered {ans.status} (never for a client's input)")
    if ans.status >= 400 and req.method != "HEAD":
        plain_parser_400 = req.parser and ans.status == 400 and ans.headers.get("content-type", "").startswith(
            "text/plain")
        if not plain_parser_400:
            shape = error_shape_problem(ans)
            if shape:
                out.append(shape)
    if req.must is not None and ans.status not in req.must:
        out.append(f"answered {ans.status}, where only {sorted(req.must)} may answer this input")
    return out


def check(target: Target, req: Req, *, health: bool = True) -> Answer:
    """Send ``req`` and fail with the input and the answer when the oracle objects."""
    try:
        ans = send(target, req)
    except (OSError, http.client.HTTPException) as exc:
        raise AssertionError(f"no answer ({exc!r}) to {req.describe()}") from exc
    found = problems(req, ans)
    if health:
        sick = health_problem(target)
        if sick:
            found.append(sick)
    assert not found, f"{'; '.join(found)}\n  input: {req.describe()}\n  answer: {ans.status} {ans.body[:600]!r}"
    return ans
