"""The HTTP ingress: what Serve's proxy calls for every request to the application.

It reads the route (and, in a job's path, the replica that holds the job), answers the requests
that reach no daemon itself (unknown routes, malformed job ids), and passes the rest to the
daemon deployment through a handle whose router (``router.JobRouter``) picks the replica. The
answer streams back unchanged but for job ids, which the replica has already bound to itself.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from ray.exceptions import RayActorError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from diffusiond.protocol import BEARER_NEEDED, ErrorCode, bearer_authorized
from diffusiond.ray import ids
from diffusiond.ray.auth import read_token
from diffusiond.ray.replica import Call, Head

# A request crosses Ray's object store whole; the daemon has its own, smaller limit (1 MiB by default).
MAX_BODY_BYTES = 64 << 20


def _own_path(request: Request) -> str:
    """The path below the application's ``route_prefix``: Serve keeps the whole path in ``scope["path"]`` and the
    prefix in ``root_path``, so with a prefix other than ``/`` every route read as unknown."""
    path: str = request.scope["path"]
    prefix: str = request.scope.get("root_path", "") or ""
    return path[len(prefix):] or "/" if prefix and path.startswith(prefix) else path


async def _body_within_limit(request: Request) -> bytes | None:
    """The body, or None once it passes ``MAX_BODY_BYTES``: counted as it comes, since a chunked upload has no
    Content-Length to refuse it by, and was read into the gateway's memory whole."""
    if int(request.headers.get("content-length") or 0) > MAX_BODY_BYTES:
        return None
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            return None
        parts.append(chunk)
    return b"".join(parts)


def unanswered(exc: BaseException, replica: str | None, adopts: bool) -> str:
    """Why a call got no answer from its replica, for the 503: a replica's death says what became of its jobs;
    anything else (Serve's backpressure, an error in the replica) is named as it is, since the replica lives on
    and its jobs with it."""
    which = f"replica {replica}" if replica else "the replica that took this request"
    if not isinstance(exc, RayActorError):
        return f"{which} could not answer: {type(exc).__name__}: {exc}"[:2000] + "; retry in a few seconds"
    fate = ("Its jobs are adopted by another replica from the shared state dir: retry in a few seconds"
            if adopts else "A job it held is lost with it: submit again")
    return f"{which} ended before it answered ({type(exc).__name__}); Serve replaces it. {fate}"


class Gateway:
    """The body of the ingress deployment; ``daemons`` is the handle to the daemon deployment."""

    def __init__(self, daemons: Any, token_file: str | None = None, token_env: str | None = None,
                 adopts: bool = False) -> None:
        self.daemons = daemons.options(stream=True)
        self.adopts = adopts  # a shared state dir: a gone replica's jobs are adopted, not lost
        self.token = read_token(token_file, token_env)  # read here: the Secret is mounted where the gateway runs

    async def __call__(self, request: Request) -> Response:
        if self.token is not None and not bearer_authorized(request.headers.get("authorization"), self.token):
            # before the route is read: a caller without the token learns nothing of the jobs or the models
            return JSONResponse(ids.error_body(ErrorCode.UNAUTHORIZED, BEARER_NEEDED), status_code=401,
                                headers={"WWW-Authenticate": "Bearer"})
        try:
            replica, path = ids.route(request.method, _own_path(request))
            query = request.url.query
            if replica is None:  # a job list's next page goes to the replica that gave its cursor
                replica, query = ids.route_query(request.method, path, query)
        except ids.RouteError as exc:
            return JSONResponse(ids.error_body(exc.code, str(exc), exc.field), status_code=exc.status)
        body = await _body_within_limit(request)
        if body is None:
            return JSONResponse(ids.error_body(ErrorCode.REQUEST_TOO_LARGE,
                                               f"the request body is over {MAX_BODY_BYTES >> 20} MiB, the most "
                                               "the Ray gateway passes on to a daemon"), status_code=413)
        key = model = None
        if replica is None and request.method == "POST":
            try:
                doc = json.loads(body)
            except (ValueError, RecursionError):  # deep nesting is a RecursionError, and was a 500 here
                doc = None  # the daemon answers 400 invalid_json naming what is wrong (or it is a form)
            key = ids.batch_key(doc)
            model = ids.model_of(doc)
        call = Call(request.method, path, query, request.headers.get("content-type"), body, replica,
                    ids.url_prefix(request.scope.get("root_path", "") or ""))
        stream = self.daemons.forward.remote(msgspec.msgpack.encode(call), replica=replica, batch_key=key,
                                             model=model)
        try:
            head = msgspec.msgpack.decode(await stream.__anext__(), type=Head)
        except Exception as exc:  # the replica's process died (RayActorError, ...), or Serve refused the call
            return JSONResponse(ids.error_body(ErrorCode.REPLICA_UNAVAILABLE, unanswered(exc, replica, self.adopts)),
                                status_code=503)

        if head.status != 200 or dict(head.headers).get("content-type", "").startswith("application/json"):
            # a document, not a stream: whole or not at all, so a replica lost between its head and
            # its body (its node gone) is a 503 with the reason, not a response cut short
            try:
                body = b"".join([chunk async for chunk in stream])
            except Exception as exc:
                which = f"replica {replica}" if replica else "the replica that took this request"
                return JSONResponse(ids.error_body(ErrorCode.REPLICA_UNAVAILABLE,
                                                   f"{which} ended while it answered ({type(exc).__name__}); "
                                                   f"retry"), status_code=503)
            return Response(body, status_code=head.status, headers=dict(head.headers))

        async def rest() -> AsyncIterator[bytes]:
            done = False
            try:
                async for chunk in stream:
                    yield chunk
                done = True
            finally:
                if not done:  # the client went away: the replica closes the daemon's request (a sync job is cancelled)
                    stream.cancel()

        return StreamingResponse(rest(), status_code=head.status, headers=dict(head.headers))
