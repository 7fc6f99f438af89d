"""``AsyncClient``: the whole SDK protocol, on asyncio and aiohttp.

``Client`` (``flotilla.client``) runs this same class on a private loop, so
every rule (retries, errors, default model, headers) lives here once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, overload

from flotilla import defaults
from flotilla.batch import run_batch
from flotilla.config import ClientConfig, ClientOptions
from flotilla.errors import ConfigError
from flotilla.params import (
    ResponseFormat,
    ResponsesText,
    ResponsesTool,
    ResponsesToolChoice,
    StructuredOutputs,
    Tool,
    ToolChoice,
)
from flotilla.progress import ProgressBar
from flotilla.prometheus import Sample, parse_prometheus
from flotilla.schema import M, OutputSchema, SchemaSpec
from flotilla.streaming import AsyncStream
from flotilla.structured import ParsedCompletion
from flotilla.transport import InvalidResponseError, Transport
from flotilla.types import BatchResult, Completion, Embeddings, Health, Model, Response, Tokens

if TYPE_CHECKING:
    from typing_extensions import Unpack

Prompt = str | list[int]  # text, or token ids
Message = Mapping[str, Any]  # {"role": ..., "content": ...}
Messages = str | Sequence[Message]  # a str is one user turn


def _messages(messages: Messages) -> list[dict[str, Any]]:
    if isinstance(messages, str):
        return [{"role": "user", "content": messages}]
    return [dict(m) for m in messages]


def _fields(**fields: Any) -> dict[str, Any]:
    """The structured-output and tool fields that were given (``None`` means leave it out)."""
    return {k: v for k, v in fields.items() if v is not None}


def _is_chat(item: Prompt | Sequence[Message]) -> bool:
    return not isinstance(item, str) and len(item) > 0 and isinstance(item[0], Mapping)


class AsyncClient:
    """An asyncio client for one flotilla server (see ``ClientOptions`` for the options).

    Use it as ``async with AsyncClient() as client:`` or call :meth:`close`.
    ``model`` may be left out of every call: the server's first model
    (``GET /v1/models``) is used, fetched once. Per call, ``session_id``
    overrides the client's and ``timeout`` the client's total timeout; every
    other keyword goes into the request body (``max_tokens``, ``temperature``,
    ``top_p``, ``top_k``, ``min_p``, ``stop``, ``seed``, ``n``, ``logprobs``,
    ``presence_penalty``, ``frequency_penalty``, ``ignore_eos``, ...).

    Structured output and tools (``flotilla.params`` types them): chat calls
    take ``response_format``, ``tools`` and ``tool_choice``; chat and
    completion calls take vLLM's ``structured_outputs``. A reply's tool calls
    are ``completion.tool_calls`` (``stream.tool_calls`` when streamed);
    :meth:`parse` asks for a schema and returns the validated object.
    """

    def __init__(self, base_url: str | None = None, **options: Unpack[ClientOptions]) -> None:
        self.config = ClientConfig.resolve(base_url, **options)
        self._transport = Transport(self.config)
        self._model: str | None = None
        self._model_lock = asyncio.Lock()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the connection pool."""
        await self._transport.close()

    # ------------------------------------------------------------ generation
    async def complete(self, prompt: Prompt, *, model: str | None = None, session_id: str | None = None,
                       timeout: float | None = None, structured_outputs: StructuredOutputs | None = None,
                       **params: Any) -> Completion:
        """``POST /v1/completions``: one prompt (text or token ids)."""
        body = await self._body(model, {**params, **_fields(structured_outputs=structured_outputs)},
                                prompt=prompt)
        reply = await self._transport.request("POST", "/v1/completions", body, session_id=session_id,
                                              timeout=timeout)
        return Completion.from_json(reply.json())

    async def chat(self, messages: Messages, *, model: str | None = None, session_id: str | None = None,
                   timeout: float | None = None, response_format: ResponseFormat | None = None,
                   tools: Sequence[Tool] | None = None, tool_choice: ToolChoice | None = None,
                   structured_outputs: StructuredOutputs | None = None, **params: Any) -> Completion:
        """``POST /v1/chat/completions``: ``messages`` as OpenAI dicts, or a str for one user turn.

        With ``tools``, read ``completion.tool_calls``; answer with an
        assistant message holding ``[c.to_json() for c in calls]`` and one
        ``{"role": "tool", "tool_call_id": c.id, "content": ...}`` per call.
        """
        fields = _fields(response_format=response_format, tools=tools, tool_choice=tool_choice,
                         structured_outputs=structured_outputs)
        body = await self._body(model, {**params, **fields}, messages=_messages(messages))
        reply = await self._transport.request("POST", "/v1/chat/completions", body, session_id=session_id,
                                              timeout=timeout)
        return Completion.from_json(reply.json())

    @overload
    async def parse(self, messages: Messages, *, response_format: type[M], name: str | None = None,
                    **params: Any) -> ParsedCompletion[M]: ...

    @overload
    async def parse(self, messages: Messages, *, response_format: Mapping[str, Any], name: str | None = None,
                    **params: Any) -> ParsedCompletion[Any]: ...

    async def parse(self, messages: Messages, *, response_format: SchemaSpec, name: str | None = None,
                    **params: Any) -> ParsedCompletion[Any]:
        """A chat whose reply must match a schema; returns it validated (``result.parsed``).

        ``response_format`` is a pydantic model class (anything with
        ``model_json_schema()`` and ``model_validate_json()``; ``parsed`` is an
        instance) or a JSON-schema dict (``parsed`` is the JSON, checked with
        ``jsonschema``, which must then be installed: ``MissingDependencyError``
        otherwise, before any request). It is sent as ``{"type": "json_schema",
        "json_schema": {"name", "schema", "strict": true}}``; ``name`` defaults
        to the class name or the schema's ``title``. Other keywords are those
        of :meth:`chat`. A reply that is not JSON or breaks the schema (say
        ``max_tokens`` cut it: ``finish_reason == "length"``) raises
        ``StructuredOutputError`` carrying the text and the finish_reason.
        """
        schema: OutputSchema[Any] = OutputSchema.of(response_format, name=name)
        completion = await self.chat(messages, response_format=schema.response_format(), **params)
        return ParsedCompletion.of(completion, schema)

    def stream(self, prompt: Prompt, *, model: str | None = None, session_id: str | None = None,
               timeout: float | None = None, structured_outputs: StructuredOutputs | None = None,
               **params: Any) -> AsyncStream:
        """A streamed completion: ``async with client.stream(p) as s: async for delta in s: ...``."""
        return self._stream("/v1/completions", {"prompt": prompt}, model, session_id, timeout,
                            {**params, **_fields(structured_outputs=structured_outputs)})

    def stream_chat(self, messages: Messages, *, model: str | None = None, session_id: str | None = None,
                    timeout: float | None = None, response_format: ResponseFormat | None = None,
                    tools: Sequence[Tool] | None = None, tool_choice: ToolChoice | None = None,
                    structured_outputs: StructuredOutputs | None = None, **params: Any) -> AsyncStream:
        """A streamed chat completion (see :meth:`stream`); its ``tool_calls`` join the streamed fragments."""
        fields = _fields(response_format=response_format, tools=tools, tool_choice=tool_choice,
                         structured_outputs=structured_outputs)
        return self._stream("/v1/chat/completions", {"messages": _messages(messages)}, model, session_id,
                            timeout, {**params, **fields})

    async def batch(self, prompts: Sequence[Prompt | Sequence[Message]], *,
                    concurrency: int = defaults.BATCH_CONCURRENCY, progress: bool = True,
                    **params: Any) -> list[BatchResult]:
        """Complete every prompt, ``concurrency`` at a time; results in input order.

        An item that is a list of message dicts is a chat; anything else a
        completion. A failed item holds its error (``result.ok`` is false);
        ``progress`` draws a bar on stderr. ``params`` apply to every item
        (``response_format``, ``tools`` and ``tool_choice`` make sense only
        for chats; ``structured_outputs`` for both).
        """
        if concurrency < 1:
            raise ConfigError(f"must be >= 1, got {concurrency}", param="concurrency")
        if params.get("model") is None:
            params["model"] = await self.default_model()  # once, before the workers start

        async def one(item: Prompt | Sequence[Message]) -> Completion:
            if _is_chat(item):
                return await self.chat(item, **params)  # type: ignore[arg-type]
            return await self.complete(item, **params)  # type: ignore[arg-type]

        bar = ProgressBar(len(prompts), enabled=progress)
        return await run_batch(prompts, one, concurrency=concurrency, progress=bar)

    async def responses(self, input: str | Sequence[Message], *, model: str | None = None,
                        instructions: str | None = None, previous_response_id: str | None = None,
                        tools: Sequence[ResponsesTool] | None = None,
                        tool_choice: ResponsesToolChoice | None = None, text: ResponsesText | None = None,
                        session_id: str | None = None, timeout: float | None = None,
                        **params: Any) -> Response:
        """``POST /v1/responses``: ``input`` a str (one user turn) or a list of input items.

        Continue a conversation with ``previous_response_id=earlier.id`` (the
        request is routed to the replica that stored it); answer a function
        call with ``{"type": "function_call_output", "call_id": call.id,
        "output": ...}`` in ``input``. ``tools`` are flat function tools,
        ``text={"format": {"type": "json_schema", "name", "schema"}}`` asks
        for JSON. Other keywords (``max_output_tokens``, ``temperature``,
        ``top_p``, ``store``, ``metadata``, ...) go into the body.
        """
        fields = _fields(instructions=instructions, previous_response_id=previous_response_id, tools=tools,
                         tool_choice=tool_choice, text=text)
        item_list = input if isinstance(input, str) else [dict(m) for m in input]
        body = await self._body(model, {**params, **fields}, input=item_list)
        reply = await self._transport.request("POST", "/v1/responses", body, session_id=session_id,
                                              timeout=timeout)
        return Response.from_json(reply.json())

    async def embed(self, input: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]], *,
                    model: str | None = None, timeout: float | None = None) -> Embeddings:
        """``POST /v1/embeddings``: one vector per input (a str, a list of str, token ids or lists of them)."""
        items: str | list[Any] = input if isinstance(input, str) else [
            x if isinstance(x, (str, int)) else list(x) for x in input]
        body = await self._body(model, {"encoding_format": "float"}, input=items)
        reply = await self._transport.request("POST", "/v1/embeddings", body, timeout=timeout)
        return Embeddings.from_json(reply.json())

    # ----------------------------------------------------------- information
    async def models(self) -> list[Model]:
        """``GET /v1/models``."""
        data = (await self._transport.request("GET", "/v1/models")).json()
        return [Model.from_json(m) for m in data.get("data") or [] if isinstance(m, Mapping)]

    async def default_model(self) -> str:
        """The server's first model, fetched once and cached."""
        async with self._model_lock:
            if self._model is None:
                models = await self.models()
                if not models:
                    raise InvalidResponseError("GET /v1/models lists no model")
                self._model = models[0].id
        return self._model

    async def health(self) -> Health:
        """``GET /health``, not retried: ``ok`` on 200; a 503 gives ``ok=False`` and the reason."""
        reply = await self._transport.request("GET", "/health", retry=False, ok_statuses=frozenset({503}))
        try:
            body = reply.json()
        except InvalidResponseError:  # a proxy's HTML page: the status says enough
            body = {}
        error = body.get("error") if isinstance(body, Mapping) else None
        message = str(error.get("message", "")) if isinstance(error, Mapping) else str(body.get("status", ""))
        return Health(reply.status == 200, reply.status, message)

    async def metrics(self) -> dict[str, list[Sample]]:
        """``GET /metrics``, parsed: family name -> samples (labels, value)."""
        reply = await self._transport.request("GET", "/metrics")
        return parse_prometheus(reply.body.decode("utf-8", "replace"))

    async def tokenize(self, prompt: str | None = None, *, messages: Messages | None = None,
                       model: str | None = None) -> Tokens:
        """``POST /tokenize`` of a prompt, or of chat messages rendered with the chat template."""
        fields: dict[str, Any] = {"prompt": prompt} if messages is None else {"messages": _messages(messages)}
        body = await self._body(model, {}, **fields)
        return Tokens.from_json((await self._transport.request("POST", "/tokenize", body)).json())

    async def detokenize(self, tokens: Sequence[int], *, model: str | None = None) -> str:
        """``POST /detokenize``: token ids back to text."""
        body = await self._body(model, {}, tokens=list(tokens))
        return str((await self._transport.request("POST", "/detokenize", body)).json().get("prompt", ""))

    # -------------------------------------------------------------- helpers
    async def _body(self, model: str | None, params: dict[str, Any], **fields: Any) -> dict[str, Any]:
        return {"model": model or await self.default_model(), **params, **fields}

    def _stream(self, path: str, fields: dict[str, Any], model: str | None, session_id: str | None,
                timeout: float | None, params: dict[str, Any]) -> AsyncStream:
        params = {**params, "stream": True}
        params.setdefault("stream_options", {"include_usage": True})

        async def body() -> dict[str, Any]:
            return await self._body(model, params, **fields)

        return AsyncStream(self._transport, path, body, session_id=session_id, timeout=timeout)
