"""A response stream to the HTTP response: the whole JSON object, or SSE; and the error response.

``LLMServer`` (``apps.replica.server``) calls these once a request's prompts are
submitted. Each takes ``release``, which the server runs when the response
is done with the stream, on every path (it aborts whatever is unfinished).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from fastapi.responses import JSONResponse

from apps.outputs.response_builder import ResponseBuilder
from apps.outputs.stream_fanout import RequestStream
from apps.protocol import models as p
from apps.protocol.errors import error_response

RETRY_AFTER_S = 1  # what a 429 or 503 tells the client to wait


def error_json(exc: BaseException) -> JSONResponse:
    """The OpenAI error envelope of ``exc``; a 429 or 503 (the same request may pass soon) carries ``Retry-After``."""
    status, body = error_response(exc)
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status in (429, 503) else None
    return JSONResponse(body, status_code=status, headers=headers)


def _usage(stream: RequestStream) -> dict[str, object]:
    return p.usage(stream.num_prompt_tokens, stream.num_completion_tokens, stream.num_cached_tokens)


async def whole(stream: RequestStream, out: ResponseBuilder, release: Callable[[], None]) -> JSONResponse:
    """Read ``stream`` to its end; the whole completion (or chat completion) object."""
    try:
        while not stream.done:
            out.add(await stream.next())
    except Exception as exc:
        return error_json(exc)
    finally:
        release()
    return JSONResponse(out.shape.response(stream.request_id, out.model, out.created, out.choices(stream.finish_reasons),
                              _usage(stream)))


async def sse(stream: RequestStream, out: ResponseBuilder, include_usage: bool,
              release: Callable[[], None]) -> AsyncIterator[bytes]:
    """The SSE events of ``stream``: chunks, the usage chunk if asked, an error event if it failed, [DONE]."""
    rid = stream.request_id
    try:
        for chunk in out.opening_chunks(rid):
            yield p.sse_event(chunk)
        while not stream.done:
            for chunk in out.chunks(rid, await stream.next_many()):
                yield p.sse_event(chunk)
        if include_usage:
            yield p.sse_event(out.usage_chunk(rid, _usage(stream)))
    except Exception as exc:
        yield p.sse_error_event(exc)
    finally:
        release()
    yield p.SSE_DONE
