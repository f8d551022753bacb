"""Status codes, chosen here and only here: the engine raises domain errors and knows nothing of HTTP.

One table gives the status of every domain error (``STATUS_OF_ERROR``), one the status of a
synchronous request whose job failed (``STATUS_OF_FAILURE``). Every error leaves as
``{"error": {...}}`` through ``errors_middleware``, aiohttp's own included (413 for a body over the
limit, 404/405 for unknown routes), so clients only ever parse one error shape. The output
socket (``handoff.py``) answers its refusals with the same statuses.

The last resort is here too: an exception nobody expected (a bug, or an input no check foresaw)
answers 500 ``internal_error`` in the same shape, never aiohttp's plain-text page. Its message
carries an id (``err_<hex>``) that is also in the one log line written for it, with the
traceback, so a user's report leads to the cause without the cause leaking to the user.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Awaitable, Callable

from aiohttp import web

from diffusiond.daemon import errors
from diffusiond.daemon.core.engine import Engine
from diffusiond.daemon.errors import EngineError
from diffusiond.protocol import ErrorCode

log = logging.getLogger(__name__)

ENGINE: web.AppKey[Engine] = web.AppKey("engine", Engine)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# The status code of every domain error, by class (the most specific class listed wins).
STATUS_OF_ERROR: dict[type[EngineError], int] = {
    errors.InvalidRequest: 400,
    errors.OutputTooLarge: 413,
    errors.UploadTooLarge: 413,
    errors.NotFound: 404,
    errors.Conflict: 409,
    errors.OutputReleased: 410,
    errors.QueueFull: 429,
    errors.Unavailable: 503,
    errors.PowerFailed: 500,
    errors.InsufficientStorage: 507,
    errors.StateWriteFailed: 500,
}
# The status code of a synchronous request whose job ended without succeeding, by failure code.
STATUS_OF_FAILURE: dict[str, int] = {
    ErrorCode.DEADLINE_EXCEEDED: 504,
    ErrorCode.SHUTTING_DOWN: 503,
    ErrorCode.CANCELLED: 409,
    ErrorCode.INSUFFICIENT_STORAGE: 507,
    ErrorCode.OUT_OF_MEMORY: 507,  # the request asked for more memory than the device had (WebDAV's "insufficient")
    ErrorCode.MODEL_LOAD_FAILED: 503,  # its model could not be loaded (residency/ondemand.py): the worker's reason
    ErrorCode.INVALID_REQUEST: 400,  # found after admission: a LoRA the model refused at its start (engine.py)
    ErrorCode.MODEL_TOO_LARGE: 400,  # found after admission: its size no longer fits (core/unrunnable.py)
}
STATUS_OF_HTTP_ERROR_CODE = {404: ErrorCode.NOT_FOUND, 405: ErrorCode.METHOD_NOT_ALLOWED}

# What a client may send again as it was: the daemon is busy, starting or stopping, not the request at fault.
# Every other error says ``x-should-retry: false``, which OpenAI's SDKs obey: they retry any 5xx, 408, 409 and
# 429 twice by default, and a job that passed its deadline (504) ran twice more for nothing.
RETRYABLE: frozenset[str] = frozenset({ErrorCode.QUEUE_FULL, ErrorCode.UNAVAILABLE, ErrorCode.SHUTTING_DOWN,
                                       ErrorCode.NO_WORKER, ErrorCode.WORKER_UNAVAILABLE})


class HttpError(EngineError):
    """An error that only the HTTP edge can have (access control, aiohttp's own refusals)."""

    def __init__(self, status: int, code: ErrorCode, message: str, *, headers: dict[str, str] | None = None,
                 stage: str | None = None) -> None:
        super().__init__(message, code=code, stage=stage)
        self.status = status
        self.headers = headers or {}


def status_of(err: EngineError) -> int:
    if isinstance(err, HttpError):
        return err.status
    for cls in type(err).__mro__:
        if cls in STATUS_OF_ERROR:
            return STATUS_OF_ERROR[cls]
    return 500


def error_response(err: EngineError) -> web.Response:
    headers = dict(err.headers) if isinstance(err, HttpError) else {}
    if err.retry_after_s is not None:
        headers["Retry-After"] = f"{err.retry_after_s:g}"
    headers.setdefault("x-should-retry", "true" if err.code in RETRYABLE or err.retry_after_s is not None
                       else "false")
    return web.json_response(err.body(), status=status_of(err), headers=headers)


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except EngineError as err:
        if status_of(err) >= 500:  # the daemon's own failure (not the client's): always in the log, with why
            log.warning("%s %s answered %d %s: %s", request.method, request.path[:200], status_of(err), err.code,
                        err.message)
        return error_response(err)
    except web.HTTPRequestEntityTooLarge as exc:
        return error_response(HttpError(413, ErrorCode.REQUEST_TOO_LARGE, f"request body is too large: {exc.text}"))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = STATUS_OF_HTTP_ERROR_CODE.get(exc.status, ErrorCode.HTTP_ERROR)
        allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None  # a 405 must say (RFC 9110)
        return error_response(HttpError(exc.status, code, f"{exc.reason}: {request.method} {request.path}",
                                         headers=allow))
    except Exception:  # the last resort: see the module's docstring
        return internal_error(request)


def internal_error(request: web.Request) -> web.Response:
    """The answer to an exception nobody expected (called inside its ``except``)."""
    return error_response(unexpected(f"{request.method} {request.path[:200]}"))


def unexpected(what: str) -> HttpError:
    """The error for an exception nobody expected while answering ``what`` (called inside its ``except``): one log
    line at ERROR with the traceback and an id, and the same id in a 500 of the one error shape."""
    err_id = f"err_{secrets.token_hex(6)}"
    log.exception("%s: unexpected error answering %s", err_id, what)
    return HttpError(
        500, ErrorCode.INTERNAL_ERROR,
        f"the daemon failed on this request ({err_id}); this is a bug in diffusiond: please report it with "
        f"this id, which is also in the daemon's log with the details")
