"""The error the gateway answers with: an HTTP status and OpenAI's ``{"error": {...}}`` body.

Its own module, below every parser, so that the request parser and the structured-output and tool parsers it calls
all raise it without importing each other in a circle.
"""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """A refused request: ``status`` with OpenAI's error ``type``, the offending ``param`` and, for 429 and 503,
    the ``Retry-After`` seconds."""

    def __init__(self, status: int, message: str, param: str | None = None, err_type: str | None = None,
                 code: str | None = None, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.err_type = err_type or ("invalid_request_error" if status < 500 else "server_error")
        self.code = code
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param, "code": self.code}}
