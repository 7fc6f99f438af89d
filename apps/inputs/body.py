"""Read an HTTP request body under a size limit, answering an oversized one with a 413 the client receives.

A handler that stops reading at the limit and answers at once leaves the
rest of the body unread; the server then closes a socket with unread data
and the client, still sending, gets a TCP reset instead of the 413 (a
4 MiB body slipped through because Serve's proxy had read it all by then; a
64 MiB one did not). So past the limit the rest is read and discarded
(never kept) before the 413 goes out, up to ``MAX_DISCARD_BYTES``; a client
sending more than that is cut off (it gets the reset, not the answer).
"""

from __future__ import annotations

from typing import Any

from apps.protocol.errors import APIError

MAX_DISCARD_BYTES = 256 * 1024 * 1024  # reading this much to say "too large" is cheap; more is abuse


def too_large(max_bytes: int) -> APIError:
    """The 413 of a body over ``max_bytes``."""
    return APIError(413, f"the request body is larger than the limit of {max_bytes} bytes",
                    code="payload_too_large")


async def read_body(request: Any, max_bytes: int) -> bytes:
    """The body of ``request`` (a Starlette ``Request``); ``APIError`` 413 once it passes ``max_bytes``.

    Memory stays bounded by ``max_bytes``: past it, chunks are counted and dropped.
    """
    chunks: list[bytes] = []
    size = 0
    over = False
    async for chunk in request.stream():
        size += len(chunk)
        if over:
            if size > MAX_DISCARD_BYTES:
                break
            continue
        if size > max_bytes:
            over = True
            chunks.clear()
            continue
        chunks.append(chunk)
    if over:
        raise too_large(max_bytes)
    return b"".join(chunks)
