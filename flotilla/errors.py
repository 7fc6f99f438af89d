"""Typed errors: one class per kind of failure, all under ``FlotillaError``.

The server answers every error in the OpenAI envelope
``{"error": {"message", "type", "param", "code"}}``; :func:`from_response`
turns a status and that body into the right ``APIStatusError`` subclass,
keeping the server's ``message``, ``param`` and ``code``. Failures below HTTP
(refused connection, dropped stream, timeout) are ``APIConnectionError`` /
``APITimeoutError``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flotilla.types import Completion


class FlotillaError(Exception):
    """The base of every error this SDK raises."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ConfigError(FlotillaError, ValueError):
    """A client option is invalid; ``param`` names it."""

    def __init__(self, message: str, *, param: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


class MissingDependencyError(FlotillaError, ImportError):
    """A feature needs an optional package that is not installed; ``package`` names it."""

    def __init__(self, message: str, *, package: str) -> None:
        super().__init__(message)
        self.package = package


class StructuredOutputError(FlotillaError, ValueError):
    """The model's structured output (``parse``, tool-call arguments) is not valid JSON or breaks the schema.

    ``text`` is the raw output and ``finish_reason`` why generation stopped
    (``"length"`` means ``max_tokens`` cut it short; ``None`` when unknown);
    ``completion`` is the whole reply when there was one. The parser's own
    exception (pydantic's ``ValidationError``, ``json.JSONDecodeError``) is
    the ``__cause__``.
    """

    def __init__(self, message: str, *, text: str, finish_reason: str | None,
                 completion: Completion | None = None) -> None:
        super().__init__(message)
        self.text = text
        self.finish_reason = finish_reason
        self.completion = completion


class APIConnectionError(FlotillaError):
    """No usable HTTP answer: the connection was refused, reset or dropped mid-stream."""


class APITimeoutError(APIConnectionError):
    """The call ran out of time. ``during_connect`` is true when no connection was made."""

    def __init__(self, message: str, *, during_connect: bool = False) -> None:
        super().__init__(message)
        self.during_connect = during_connect


class APIStatusError(FlotillaError):
    """The server answered with an error status (or sent an error event in a stream).

    ``status`` is the HTTP status; for an error event inside a stream (which
    carries no status) it is inferred from the envelope's ``type``: 500 for
    ``server_error``, else 400. ``retry_after`` is the server's Retry-After in
    seconds, if it sent one. ``enveloped`` is False when the body was not the
    OpenAI error envelope: the answer came from something in front of the
    server (Serve's proxy answers a bare "Internal Server Error" when the
    replica it chose dies), not from flotilla itself.
    """

    def __init__(self, message: str, *, status: int, param: str | None = None, code: str | None = None,
                 type: str | None = None, retry_after: float | None = None, enveloped: bool = True) -> None:
        super().__init__(message)
        self.status = status
        self.enveloped = enveloped
        self.param = param
        self.code = code
        self.type = type
        self.retry_after = retry_after

    def __str__(self) -> str:
        where = f", param={self.param!r}" if self.param else ""
        return f"{self.status}: {self.message}{where}"


class BadRequestError(APIStatusError):
    """400 or 422: the request is invalid; ``param`` names the field at fault."""


class AuthenticationError(APIStatusError):
    """401 or 403: missing, wrong or insufficient API key."""


class NotFoundError(APIStatusError):
    """404: unknown model or route."""


class PayloadTooLargeError(APIStatusError):
    """413: the request body is over the server's limit."""


class RateLimitError(APIStatusError):
    """429: too many requests; retried after the server's Retry-After."""


class ServerError(APIStatusError):
    """5xx: the server failed or is unavailable."""


_BY_STATUS: dict[int, type[APIStatusError]] = {
    400: BadRequestError, 422: BadRequestError, 401: AuthenticationError, 403: AuthenticationError,
    404: NotFoundError, 413: PayloadTooLargeError, 429: RateLimitError,
}


def status_error_class(status: int) -> type[APIStatusError]:
    """The class for an HTTP error status (other 4xx: ``APIStatusError`` itself)."""
    if status >= 500:
        return ServerError
    return _BY_STATUS.get(status, APIStatusError)


def _field(error: Mapping[str, Any], key: str) -> str | None:
    value = error.get(key)
    return None if value is None else str(value)


def from_response(status: int, body: Any, *, retry_after: float | None = None,
                  fallback: str = "") -> APIStatusError:
    """The typed error for ``status`` and a parsed body (the OpenAI envelope, or anything else)."""
    error = body.get("error") if isinstance(body, Mapping) else None
    if not isinstance(error, Mapping):
        text = fallback or f"HTTP {status}"
        return status_error_class(status)(text, status=status, retry_after=retry_after, enveloped=False)
    message = _field(error, "message") or fallback or f"HTTP {status}"
    return status_error_class(status)(message, status=status, param=_field(error, "param"),
                                      code=_field(error, "code"), type=_field(error, "type"),
                                      retry_after=retry_after)


def from_stream_event(body: Mapping[str, Any]) -> APIStatusError:
    """The typed error for a ``data: {"error": ...}`` event sent after a stream began."""
    error = body.get("error")
    kind = error.get("type") if isinstance(error, Mapping) else None
    return from_response(500 if kind == "server_error" else 400, body)
