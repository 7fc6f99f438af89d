"""``Client``: the blocking face of ``AsyncClient``, run on a private event loop thread.

Every method hands the matching ``AsyncClient`` coroutine to the loop and
waits, so the protocol (retries, errors, default model) has one
implementation. ``Stream`` does the same for a streamed completion.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, overload

from flotilla.async_client import AsyncClient, Message, Messages, Prompt
from flotilla.config import ClientConfig, ClientOptions
from flotilla.loop_thread import LoopThread
from flotilla.prometheus import Sample
from flotilla.schema import M, SchemaSpec
from flotilla.streaming import AsyncStream, StreamView
from flotilla.structured import ParsedCompletion
from flotilla.types import (
    BatchResult,
    Completion,
    Embeddings,
    Health,
    Model,
    Response,
    StreamDelta,
    Tokens,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack


class Stream(StreamView, Iterator[StreamDelta]):
    """An iterator of ``StreamDelta`` and a context manager that closes the connection."""

    def __init__(self, loop: LoopThread, inner: AsyncStream) -> None:
        self._loop = loop
        self._inner = inner
        self._state = inner._state

    def __enter__(self) -> Stream:
        self._loop.run(self._inner.__aenter__())
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> StreamDelta:
        try:
            return self._loop.run(self._inner.__anext__())
        except StopAsyncIteration:
            raise StopIteration from None

    def close(self) -> None:
        """Release the connection (before the end this cancels the request)."""
        if not self._loop.closed:
            self._loop.run(self._inner.aclose())


def _shutdown(loop: LoopThread, inner: AsyncClient) -> None:
    if not loop.closed:
        loop.run(inner.close())
        loop.close()


class Client:
    """A blocking client for one flotilla server; same options and calls as ``AsyncClient``.

    Use it as ``with Client() as client:`` or call :meth:`close` (it is also
    closed when garbage-collected or at exit). Keywords of each call are those
    of the ``AsyncClient`` method of the same name (``chat`` and ``stream_chat``
    take ``response_format``, ``tools``, ``tool_choice`` and
    ``structured_outputs``; ``complete`` and ``stream`` take
    ``structured_outputs``).
    """

    def __init__(self, base_url: str | None = None, **options: Unpack[ClientOptions]) -> None:
        self._async = AsyncClient(base_url, **options)
        self._loop = LoopThread()
        self._finalizer = weakref.finalize(self, _shutdown, self._loop, self._async)

    @property
    def config(self) -> ClientConfig:
        return self._async.config

    def __enter__(self) -> Client:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection pool and stop the loop thread."""
        self._finalizer()

    def complete(self, prompt: Prompt, **params: Any) -> Completion:
        """See ``AsyncClient.complete``."""
        return self._loop.run(self._async.complete(prompt, **params))

    def chat(self, messages: Messages, **params: Any) -> Completion:
        """See ``AsyncClient.chat``."""
        return self._loop.run(self._async.chat(messages, **params))

    @overload
    def parse(self, messages: Messages, *, response_format: type[M], name: str | None = None,
              **params: Any) -> ParsedCompletion[M]: ...

    @overload
    def parse(self, messages: Messages, *, response_format: Mapping[str, Any], name: str | None = None,
              **params: Any) -> ParsedCompletion[Any]: ...

    def parse(self, messages: Messages, *, response_format: SchemaSpec, name: str | None = None,
              **params: Any) -> ParsedCompletion[Any]:
        """A chat whose reply must match a pydantic model or JSON schema (see ``AsyncClient.parse``).

        ``client.parse(messages, response_format=Weather).parsed`` is a
        ``Weather``; a reply that does not match raises ``StructuredOutputError``.
        """
        return self._loop.run(self._async.parse(messages, response_format=response_format, name=name, **params))

    def stream(self, prompt: Prompt, **params: Any) -> Stream:
        """``with client.stream(p) as s: for delta in s: ...`` (see ``AsyncClient.stream``)."""
        return Stream(self._loop, self._async.stream(prompt, **params))

    def stream_chat(self, messages: Messages, **params: Any) -> Stream:
        """See ``AsyncClient.stream_chat``."""
        return Stream(self._loop, self._async.stream_chat(messages, **params))

    def batch(self, prompts: Sequence[Prompt | Sequence[Message]], **params: Any) -> list[BatchResult]:
        """See ``AsyncClient.batch`` (``concurrency``, ``progress`` and request params)."""
        return self._loop.run(self._async.batch(prompts, **params))

    def responses(self, input: str | Sequence[Message], **params: Any) -> Response:
        """See ``AsyncClient.responses`` (``previous_response_id`` continues a conversation)."""
        return self._loop.run(self._async.responses(input, **params))

    def embed(self, input: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
              **params: Any) -> Embeddings:
        """See ``AsyncClient.embed``."""
        return self._loop.run(self._async.embed(input, **params))

    def models(self) -> list[Model]:
        return self._loop.run(self._async.models())

    def default_model(self) -> str:
        return self._loop.run(self._async.default_model())

    def health(self) -> Health:
        return self._loop.run(self._async.health())

    def metrics(self) -> dict[str, list[Sample]]:
        return self._loop.run(self._async.metrics())

    def tokenize(self, prompt: str | None = None, **params: Any) -> Tokens:
        """See ``AsyncClient.tokenize`` (``messages=``, ``model=``)."""
        return self._loop.run(self._async.tokenize(prompt, **params))

    def detokenize(self, tokens: Sequence[int], **params: Any) -> str:
        return self._loop.run(self._async.detokenize(tokens, **params))
