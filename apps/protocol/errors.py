"""Map any exception to the OpenAI error envelope: ``(status, {"error": {...}})``.

The HTTP layer (Serve deployment, SSE stream) calls :func:`error_response` on
whatever went wrong and sends the result; it never formats errors itself.

- :class:`APIError`: its own status, param, type and code (404 unknown model,
  413 body too large, 400 from request parsing).
- ``InvalidParameterError`` (scheduling), ``CacheConfigError`` (kvcache) and
  pydantic ``ValidationError``: 400 naming the parameter at fault.
- Anything else: 500 with a generic message; the exception text (which may
  hold paths, tensors or a Ray traceback) is logged, never sent.

Errors that crossed a Ray actor boundary arrive wrapped (``RayTaskError``
subclasses the cause's class but its ``str`` is the remote traceback), so the
original exception is unwrapped from its ``cause`` first.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from kvcache.errors import CacheConfigError
from scheduling.errors import InvalidParameterError

logger = logging.getLogger(__name__)

INVALID_REQUEST_ERROR = "invalid_request_error"
SERVER_ERROR = "server_error"
INTERNAL_ERROR_MESSAGE = "The server had an error while processing your request."


def error_type(status: int) -> str:
    """The OpenAI ``type`` for a status: client errors vs server errors."""
    return SERVER_ERROR if status >= 500 else INVALID_REQUEST_ERROR


class APIError(Exception):
    """An error the HTTP layer answers with a chosen status.

    ``type`` defaults to ``invalid_request_error`` for 4xx and ``server_error``
    for 5xx, as OpenAI does.
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        type: str | None = None,  # the envelope field name
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type if type is not None else error_type(status)
        self.code = code

    def __reduce__(self) -> tuple[Any, ...]:
        # Keyword-only arguments: rebuild through a helper so pickling (Ray) works.
        return (_rebuild_api_error, (self.status, self.message, self.param, self.type, self.code))


def _rebuild_api_error(
    status: int, message: str, param: str | None, type_: str, code: str | None
) -> APIError:
    return APIError(status, message, param=param, type=type_, code=code)


def envelope(
    message: str, *, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """The OpenAI error body: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def unwrapped(exc: BaseException) -> BaseException:
    """The user exception inside Ray's wrappers (they keep it in ``cause``)."""
    for _ in range(8):  # bounded: a wrapper chain is never deep
        cause = vars(exc).get("cause") if hasattr(exc, "__dict__") else None
        if not isinstance(cause, BaseException) or cause is exc:
            break
        exc = cause
    return exc


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none", "list", "dict"})


def _is_path_part(part: str) -> bool:
    """Field names and list indices; not the type tags pydantic adds for union members."""
    if part.isdigit():
        return True
    return part.isidentifier() and part not in _TYPE_TAGS and not part[0].isupper()


def _validation_param(exc: ValidationError) -> tuple[str | None, str]:
    """``param`` = the first error's top-level field; the message gives its path and what failed.

    A value that fits no member of a union (``"stop": 5``) fails once per
    member; those messages are joined so the user sees every accepted shape.
    """
    errors = exc.errors(include_url=False, include_input=False)
    if not errors:
        return None, "invalid request"
    loc = [str(part) for part in errors[0]["loc"]]
    param = loc[0] if loc else None
    path = ".".join(p for p in loc if _is_path_part(p))
    msgs: list[str] = []
    for err in errors:
        if err["loc"][:1] == errors[0]["loc"][:1]:
            msg = err["msg"].removeprefix("Value error, ")
            if msg not in msgs:
                msgs.append(msg)
    text = " or ".join(msgs[:3])
    return param, f"{path}: {text}" if path else text


def renamed(exc: BaseException, names: Mapping[str, str]) -> BaseException:
    """``exc`` naming its field as the endpoint's request calls it.

    An endpoint that reuses another's path (the Responses API over chat,
    embeddings over prompts) gets errors naming the other's fields; a
    ``param`` found in ``names`` is replaced, in the param and in the message.
    Ray's wrappers are unwrapped first (an engine refusal crosses an actor).
    """
    exc = unwrapped(exc)
    if isinstance(exc, InvalidParameterError) and exc.param in names:
        new = names[exc.param]
        return InvalidParameterError(new, exc.message.replace(exc.param, new))
    if isinstance(exc, APIError) and exc.param is not None and exc.param in names:
        return APIError(exc.status, exc.message, param=names[exc.param], type=exc.type, code=exc.code)
    return exc


def error_response(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """Map any exception to ``(HTTP status, OpenAI error envelope)``."""
    exc = unwrapped(exc)
    if isinstance(exc, APIError):
        return exc.status, envelope(exc.message, type=exc.type, param=exc.param, code=exc.code)
    if isinstance(exc, ValidationError):
        param, message = _validation_param(exc)
        return 400, envelope(message, type=INVALID_REQUEST_ERROR, param=param)
    if isinstance(exc, (InvalidParameterError, CacheConfigError)):
        param = exc.param
        message = f"{param}: {exc.message}" if param else exc.message
        return 400, envelope(message, type=INVALID_REQUEST_ERROR, param=param)
    logger.error("internal error while serving a request", exc_info=exc)
    return 500, envelope(INTERNAL_ERROR_MESSAGE, type=SERVER_ERROR)
