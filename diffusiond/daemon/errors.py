"""The one error type the HTTP layer turns into ``{"error": {...}}`` with a status code."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        field: str | None = None,
        stage: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.field = field
        self.stage = stage
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        err: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.field is not None:
            err["field"] = self.field
        if self.stage is not None:
            err["stage"] = self.stage
        return {"error": err}


def bad_request(message: str, field: str | None = None, code: str = "invalid_request") -> ApiError:
    return ApiError(400, code, message, field=field)
