"""Server-sent events: lines in, each event's ``data`` out (``[DONE]`` included, as sent).

Follows the parts of the SSE format the server uses: ``data:`` lines (several
are joined with newlines), a blank line ends an event, ``:`` starts a comment,
other fields (``event``, ``id``, ``retry``) are ignored. An event cut off by
the end of the stream (no blank line yet) is dropped, as the format says.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator

DONE = "[DONE]"


class SSEDecoder:
    """Feeds on lines one at a time; returns an event's data when a blank line completes it."""

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, raw: bytes | str) -> str | None:
        line = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        line = line.rstrip("\r\n")
        if not line:
            if not self._data:
                return None
            data, self._data = "\n".join(self._data), []
            return data
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None


async def iter_sse(lines: AsyncIterable[bytes]) -> AsyncIterator[str]:
    """Each event's data from a stream of lines (aiohttp's ``response.content`` iterates lines)."""
    decoder = SSEDecoder()
    async for line in lines:
        data = decoder.feed(line)
        if data is not None:
            yield data
