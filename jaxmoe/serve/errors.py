"""Errors a route returns, and their bodies in each API's own shape.

OpenAI: ``{"error": {"message", "type", "param", "code"}}``; Anthropic:
``{"type": "error", "error": {"type", "message"}}`` with its own type names
(``invalid_request_error``, ``authentication_error``, ``not_found_error``, ``rate_limit_error``,
``api_error``, ``timeout_error``).
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
}
_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    408: "timeout_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
    504: "timeout_error",
}
_OPENAI_CODES = {401: "invalid_api_key", 404: "model_not_found", 429: "rate_limit_exceeded"}


class APIError(Exception):
    """An error answer: HTTP status, a message naming the field, the field (OpenAI ``param``)."""

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.headers = dict(headers or {})


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def openai_body(error: APIError) -> dict:
    code = _OPENAI_CODES.get(error.status)
    kind = _OPENAI_TYPES.get(error.status, "server_error")
    return {"error": {"message": error.message, "type": kind, "param": error.param, "code": code}}


def anthropic_body(error: APIError) -> dict:
    kind = _ANTHROPIC_TYPES.get(error.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def is_anthropic(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_response(error: APIError, path: str, headers: dict | None = None) -> JSONResponse:
    body = anthropic_body(error) if is_anthropic(path) else openai_body(error)
    return JSONResponse(body, status_code=error.status, headers={**error.headers, **(headers or {})})
