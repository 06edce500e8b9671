"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with a 4xx/5xx status.

The official ``openai`` client maps the status to its exception (400 BadRequestError, 404 NotFoundError, 422
UnprocessableEntityError, 500 InternalServerError) and reads ``message`` from this body.
"""

from __future__ import annotations

from typing import Any

_TYPES = {400: "invalid_request_error", 404: "not_found_error", 422: "invalid_request_error",
          500: "internal_server_error", 503: "service_unavailable"}


class ApiError(Exception):
    """A request the server refuses (or could not answer): its HTTP ``status``, a one-line ``message``, the request
    field at fault (``param``) and a short machine-readable ``code``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        """The JSON body OpenAI's API answers an error with."""
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    """A 400: the request names something this server cannot do or a field out of its range."""
    return ApiError(400, message, param, code)
