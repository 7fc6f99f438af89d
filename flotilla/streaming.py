"""``AsyncStream``: the deltas of one SSE completion, with its timings.

The stream opens lazily (``async with`` or the first ``anext``) and reads
events until its first delta; only that opening is retried, so a stream that
fails before its first token is tried again, and one that fails after is
never replayed (the caller has already seen text). Closing it (leaving the
``async with``, ``aclose``, or the end of the stream) releases the connection;
closing early makes the server abort the request.

Timings: ``ttft_s`` is from the call (retries included) to the first chunk
with text or a tool-call fragment; ``inter_token_s`` holds the gaps between
later such chunks (the server sends one chunk per engine step, usually one
token).

Tool calls: each chunk's ``delta.tool_calls`` fragments are joined by index
as the openai client joins them (``flotilla.tools.ToolCallAccumulator``);
``stream.tool_calls`` is sequence 0's calls so far.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import aiohttp

from flotilla.errors import APIConnectionError, from_stream_event
from flotilla.sse import DONE, iter_sse
from flotilla.tools import ToolCall, ToolCallAccumulator
from flotilla.transport import InvalidResponseError, Transport, translate_errors
from flotilla.types import StreamDelta, Usage

BodyFactory = Callable[[], Awaitable[dict[str, Any]]]


@dataclass
class StreamState:
    """What a stream has seen so far; shared by the async stream and its sync wrapper."""

    start: float = field(default_factory=time.monotonic)
    id: str = ""
    model: str = ""
    texts: dict[int, list[str]] = field(default_factory=dict)
    finish_reasons: dict[int, str] = field(default_factory=dict)
    tool_calls: dict[int, ToolCallAccumulator] = field(default_factory=dict)
    usage: Usage | None = None
    ttft_s: float | None = None
    inter_token_s: list[float] = field(default_factory=list)
    num_attempts: int = 0
    done: bool = False
    _last_token: float = 0.0

    def record(self, chunk: dict[str, Any], deltas: list[StreamDelta]) -> None:
        now = time.monotonic()
        self.id = str(chunk.get("id") or self.id)
        self.model = str(chunk.get("model") or self.model)
        self.usage = Usage.from_json(chunk.get("usage")) or self.usage
        for d in deltas:
            self.texts.setdefault(d.index, []).append(d.text)
            if d.finish_reason:
                self.finish_reasons[d.index] = d.finish_reason
            for fragment in d.tool_calls:
                self.tool_calls.setdefault(d.index, ToolCallAccumulator()).add(fragment)
        if any(d.text or d.tool_calls for d in deltas):
            if self.ttft_s is None:
                self.ttft_s = now - self.start
            else:
                self.inter_token_s.append(now - self._last_token)
            self._last_token = now


class StreamView:
    """Read-only accessors over a ``StreamState`` (text so far, finish, usage, timings)."""

    _state: StreamState

    @property
    def text(self) -> str:
        """Sequence 0's text so far."""
        return "".join(self._state.texts.get(0, []))

    @property
    def texts(self) -> list[str]:
        """Every sequence's text so far, by index."""
        n = max(self._state.texts, default=-1) + 1
        return ["".join(self._state.texts.get(i, [])) for i in range(n)]

    @property
    def finish_reason(self) -> str | None:
        return self._state.finish_reasons.get(0)

    @property
    def tool_calls(self) -> list[ToolCall]:
        """Sequence 0's tool calls so far, joined from the streamed fragments (whole once it finished)."""
        acc = self._state.tool_calls.get(0)
        return acc.calls() if acc is not None else []

    @property
    def usage(self) -> Usage | None:
        """Set by the last chunk when the stream asked for usage (the SDK's default)."""
        return self._state.usage

    @property
    def id(self) -> str:
        return self._state.id

    @property
    def ttft_s(self) -> float | None:
        return self._state.ttft_s

    @property
    def inter_token_s(self) -> list[float]:
        return list(self._state.inter_token_s)

    @property
    def num_attempts(self) -> int:
        return self._state.num_attempts


class AsyncStream(StreamView):
    """An async iterator of ``StreamDelta`` and an async context manager that closes it."""

    def __init__(self, transport: Transport, path: str, body: BodyFactory, *,
                 session_id: str | None = None, timeout: float | None = None) -> None:
        self._transport = transport
        self._path = path
        self._body = body
        self._session_id = session_id
        self._timeout = timeout
        self._state = StreamState()
        self._resp: aiohttp.ClientResponse | None = None
        self._events: AsyncIterator[str] | None = None
        self._pending: list[StreamDelta] = []
        self._closed = False

    async def __aenter__(self) -> AsyncStream:
        await self._open()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> StreamDelta:
        try:
            if self._resp is None and not self._closed:
                await self._open()
            while not self._pending and not self._state.done and not self._closed:
                self._pending = await self._next_deltas()
        except BaseException:
            await self.aclose()
            raise
        if self._pending:
            return self._pending.pop(0)
        await self.aclose()
        raise StopAsyncIteration

    async def aclose(self) -> None:
        """Release the connection; before the end of the stream this cancels the request."""
        self._closed = True
        resp, self._resp = self._resp, None
        if resp is not None:
            if self._state.done:
                resp.release()
            else:
                resp.close()

    async def _open(self) -> None:
        """Connect and read up to the first delta, retrying failures per the client's policy."""
        if self._resp is not None or self._closed:
            return
        body = await self._body()

        async def attempt() -> tuple[aiohttp.ClientResponse, list[StreamDelta]]:
            self._state.num_attempts += 1
            resp = await self._transport.open("POST", self._path, body, session_id=self._session_id,
                                              timeout=self._timeout)
            self._resp, self._events = resp, iter_sse(resp.content)
            try:
                if resp.content_type != "text/event-stream":  # a server that ignored stream=true
                    raise InvalidResponseError(f"expected text/event-stream, got {resp.content_type}")
                first: list[StreamDelta] = []
                while not first and not self._state.done:
                    first = await self._next_deltas()
                return resp, first
            except BaseException:
                self._resp = None
                resp.close()
                raise

        self._resp, self._pending = await self._transport.retry.call(attempt)

    async def _next_deltas(self) -> list[StreamDelta]:
        """The deltas of the next event (maybe none); sets ``done`` at ``[DONE]``."""
        assert self._events is not None  # set by _open before any read
        with translate_errors(f"POST {self._path} (stream)"):
            try:
                data = await self._events.__anext__()
            except StopAsyncIteration:
                raise APIConnectionError(f"POST {self._path}: the stream ended before [DONE]") from None
        if data == DONE:
            self._state.done = True
            return []
        try:
            chunk = json.loads(data)
        except ValueError:
            raise InvalidResponseError(f"a stream event is not JSON: {data[:200]!r}") from None
        if not isinstance(chunk, dict):
            raise InvalidResponseError(f"a stream event is not a JSON object: {data[:200]!r}")
        if "error" in chunk:
            raise from_stream_event(chunk)
        deltas = StreamDelta.from_chunk(chunk)
        self._state.record(chunk, deltas)
        return deltas
