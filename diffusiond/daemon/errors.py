"""The engine's domain errors: what went wrong, in the engine's words, with no HTTP in them.

The engine and the request checks raise these; the HTTP edge (``edge/status.py``) picks the status
code and headers for each class in one table, the way Starlette's exception handlers do. So the
engine can be driven by tests, or by another front end, without knowing HTTP exists.

    EngineError
    ├── InvalidRequest        a field is wrong (names the field)
    │   ├── OutputTooLarge    the job would make more bytes than the limit
    │   └── UploadTooLarge    a body or an edit's images over their size limit
    ├── NotFound              ModelNotFound, JobNotFound, OutputNotFound
    ├── Conflict              JobFinished, OutputNotReady, TraceOff, NotShared, UpdateSplit
    ├── OutputReleased        an npy output that was already streamed once
    ├── QueueFull             the admission queue is full (``retry_after_s``)
    ├── Unavailable           NotAccepting, NoWorker, WorkerUnavailable (``retry_after_s``)
    ├── PowerFailed           sleep or wake failed on a worker
    ├── InsufficientStorage   the state dir's disk is full (names the dir)
    └── StateWriteFailed      the state dir could not be written for another reason
"""

from __future__ import annotations

from typing import Any, ClassVar

from diffusiond.protocol import ErrorCode


class EngineError(Exception):
    default_code: ClassVar[ErrorCode] = ErrorCode.INVALID_REQUEST

    def __init__(self, message: str, *, field: str | None = None, stage: str | None = None,
                 code: ErrorCode | None = None, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        self.stage = stage
        self.retry_after_s = retry_after_s
        self.code: ErrorCode = code or self.default_code  # an instance may be more precise than its class

    def body(self) -> dict[str, Any]:
        """The ``{"error": {...}}`` document every error response carries."""
        err: dict[str, Any] = {"code": str(self.code), "message": self.message}
        if self.field is not None:
            err["field"] = self.field
        if self.stage is not None:
            err["stage"] = self.stage
        return {"error": err}


class InvalidRequest(EngineError):
    default_code = ErrorCode.INVALID_REQUEST


class OutputTooLarge(InvalidRequest):
    default_code = ErrorCode.OUTPUT_TOO_LARGE


class UploadTooLarge(InvalidRequest):
    """A body over ``limits.max_body_bytes``, or its images over ``limits.max_upload_bytes`` (413)."""

    default_code = ErrorCode.REQUEST_TOO_LARGE


class NotFound(EngineError):
    default_code = ErrorCode.NOT_FOUND


class ModelNotFound(NotFound):
    default_code = ErrorCode.MODEL_NOT_FOUND


class JobNotFound(NotFound):
    default_code = ErrorCode.JOB_NOT_FOUND


class OutputNotFound(NotFound):
    default_code = ErrorCode.OUTPUT_NOT_FOUND


class PreviewNotFound(NotFound):
    default_code = ErrorCode.PREVIEW_NOT_FOUND


class WebOff(NotFound):
    default_code = ErrorCode.WEB_OFF


class Conflict(EngineError):
    default_code = ErrorCode.JOB_FINISHED


class UpdateSplit(Conflict):
    """A live update applied by some workers of a model and not by others."""

    default_code = ErrorCode.UPDATE_SPLIT


class JobFinished(Conflict):
    default_code = ErrorCode.JOB_FINISHED


class OutputNotReady(Conflict):
    default_code = ErrorCode.OUTPUT_NOT_READY


class TraceOff(Conflict):
    default_code = ErrorCode.TRACE_OFF


class OutputReleased(EngineError):
    default_code = ErrorCode.OUTPUT_RELEASED


class NotShared(Conflict):
    """The output exists but not as sealed shared memory (encoded, spilled, or an old kernel)."""

    default_code = ErrorCode.NOT_SHARED


class QueueFull(EngineError):
    default_code = ErrorCode.QUEUE_FULL


class ModelTooLarge(InvalidRequest):
    """The job's model cannot fit its device's budget even alone: no wait would help."""

    default_code = ErrorCode.MODEL_TOO_LARGE


class Unavailable(EngineError):
    default_code = ErrorCode.UNAVAILABLE


class NotAccepting(Unavailable):
    default_code = ErrorCode.UNAVAILABLE


class NoWorker(Unavailable):
    default_code = ErrorCode.NO_WORKER


class WorkerUnavailable(Unavailable):
    default_code = ErrorCode.WORKER_UNAVAILABLE


class PowerFailed(EngineError):
    default_code = ErrorCode.SLEEP_FAILED


class InsufficientStorage(EngineError):
    default_code = ErrorCode.INSUFFICIENT_STORAGE


class StateWriteFailed(EngineError):
    default_code = ErrorCode.STATE_FAILED


def invalid(message: str, field: str | None = None, code: ErrorCode = ErrorCode.INVALID_REQUEST) -> InvalidRequest:
    """The 400 every request check raises: the message says what is wrong and with which value."""
    return InvalidRequest(message, field=field, code=code)


MAX_INT_DIGITS = 20  # every integer field's range fits here (seeds are below 2**63); more is a typo or a probe


def shown(value: float) -> str:
    """A number for a message: ``:g`` of a float, an integer as it is (``:g`` of an int over 10**308
    raises OverflowError) unless it is too long to be worth showing (a probe's 400 digits echoed back)."""
    if isinstance(value, int):
        return str(value) if abs(value).bit_length() <= 66 else f"a number of over {MAX_INT_DIGITS} digits"
    return f"{value:g}"
