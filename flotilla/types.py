"""Result types: small frozen dataclasses read from the server's JSON.

Each ``from_json`` takes one parsed JSON object as the server sends it
(OpenAI shapes) and keeps what a caller needs; unknown fields are ignored so
newer servers keep working.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from flotilla.errors import FlotillaError
from flotilla.tools import ToolCall, ToolCallDelta

Json = Mapping[str, Any]


def _int(obj: Json, key: str, default: int = 0) -> int:
    value = obj.get(key)
    return int(value) if isinstance(value, (int, float)) else default


def _opt_int(obj: Json, key: str) -> int | None:
    value = obj.get(key)
    return int(value) if isinstance(value, int) else None


@dataclass(frozen=True)
class Usage:
    """Token counts of one request; ``cached_tokens`` prompt tokens came from the prefix cache."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_tokens: int = 0

    @classmethod
    def from_json(cls, obj: Any) -> Usage | None:
        if not isinstance(obj, Mapping):
            return None
        details = obj.get("prompt_tokens_details")
        cached = _int(details, "cached_tokens") if isinstance(details, Mapping) else 0
        return cls(_int(obj, "prompt_tokens"), _int(obj, "completion_tokens"), _int(obj, "total_tokens"), cached)


def _choice_text(choice: Json) -> str:
    """A choice's text: ``text`` (completions), ``message.content`` or ``delta.content`` (chat)."""
    if "text" in choice:
        return str(choice.get("text") or "")
    body = choice.get("message") or choice.get("delta") or {}
    return str(body.get("content") or "") if isinstance(body, Mapping) else ""


def _message_tool_calls(choice: Json) -> list[ToolCall]:
    """``message.tool_calls`` of a whole chat choice (a streamed ``delta`` has fragments instead)."""
    message = choice.get("message")
    calls = message.get("tool_calls") if isinstance(message, Mapping) else None
    return [ToolCall.from_json(c) for c in calls if isinstance(c, Mapping)] if isinstance(calls, list) else []


@dataclass(frozen=True)
class Choice:
    """One generated sequence (``n`` > 1 gives several).

    ``tool_calls`` are the functions a chat reply asks for (its ``text`` is
    then usually empty and ``finish_reason`` ``"tool_calls"``).
    """

    index: int
    text: str
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)

    @classmethod
    def from_json(cls, obj: Json) -> Choice:
        lp = obj.get("logprobs")
        return cls(_int(obj, "index"), _choice_text(obj), obj.get("finish_reason"),
                   dict(lp) if isinstance(lp, Mapping) else None, _message_tool_calls(obj))


@dataclass(frozen=True)
class Completion:
    """A whole completion or chat completion; ``text`` and ``finish_reason`` are the first choice's."""

    id: str
    model: str
    object: str
    created: int
    choices: list[Choice]
    usage: Usage | None

    @property
    def text(self) -> str:
        return self.choices[0].text if self.choices else ""

    @property
    def finish_reason(self) -> str | None:
        return self.choices[0].finish_reason if self.choices else None

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The first choice's tool calls (empty when it asked for none)."""
        return self.choices[0].tool_calls if self.choices else []

    @classmethod
    def from_json(cls, obj: Json) -> Completion:
        choices = [Choice.from_json(c) for c in obj.get("choices") or [] if isinstance(c, Mapping)]
        return cls(str(obj.get("id", "")), str(obj.get("model", "")), str(obj.get("object", "")),
                   _int(obj, "created"), sorted(choices, key=lambda c: c.index), Usage.from_json(obj.get("usage")))


@dataclass(frozen=True)
class StreamDelta:
    """New text of one sequence from one streamed chunk; the last one has ``finish_reason``.

    ``tool_calls`` holds the chunk's tool-call fragments as sent; the stream
    joins them (``stream.tool_calls``).
    """

    text: str
    index: int = 0
    finish_reason: str | None = None
    logprobs: dict[str, Any] | None = None
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    @classmethod
    def from_chunk(cls, chunk: Json) -> list[StreamDelta]:
        """The deltas of one chunk that carry something (text, a finish, logprobs or tool calls).

        A chat stream's first chunk (the role alone) and the usage chunk give none.
        """
        out = []
        for choice in chunk.get("choices") or []:
            if not isinstance(choice, Mapping):
                continue
            c = Choice.from_json(choice)
            delta = choice.get("delta")
            calls = ToolCallDelta.list_from_json(delta.get("tool_calls")) if isinstance(delta, Mapping) else []
            if c.text or c.finish_reason or c.logprobs or calls:
                out.append(cls(c.text, c.index, c.finish_reason, c.logprobs, calls))
        return out


@dataclass(frozen=True)
class Model:
    """One served model (``GET /v1/models``)."""

    id: str
    owned_by: str
    created: int
    max_model_len: int | None

    @classmethod
    def from_json(cls, obj: Json) -> Model:
        return cls(str(obj.get("id", "")), str(obj.get("owned_by", "")), _int(obj, "created"),
                   _opt_int(obj, "max_model_len"))


@dataclass(frozen=True)
class Health:
    """``GET /health``: ``ok`` on 200; otherwise the status and the server's reason."""

    ok: bool
    status: int
    message: str


@dataclass(frozen=True)
class Tokens:
    """``POST /tokenize``: the token ids, their count and the model's context length."""

    tokens: list[int]
    count: int
    max_model_len: int | None

    @classmethod
    def from_json(cls, obj: Json) -> Tokens:
        tokens = [int(t) for t in obj.get("tokens") or []]
        return cls(tokens, _int(obj, "count", len(tokens)), _opt_int(obj, "max_model_len"))


@dataclass(frozen=True)
class BatchResult:
    """One item of ``batch``: ``completion`` on success, else ``error``; ``index`` is its input position."""

    index: int
    completion: Completion | None = None
    error: FlotillaError | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def unwrap(self) -> Completion:
        """The completion, or raise the item's error."""
        if self.error is not None:
            raise self.error
        assert self.completion is not None  # a result holds exactly one of the two
        return self.completion


@dataclass(frozen=True)
class Response:
    """A ``/v1/responses`` answer: its id (for ``previous_response_id``), status, text and function calls.

    ``status`` is "completed", or "incomplete" when ``max_output_tokens`` cut
    it; ``usage`` counts input tokens as ``prompt_tokens`` and output tokens as
    ``completion_tokens``; ``raw`` is the whole object as the server sent it.
    """

    id: str
    model: str
    status: str
    text: str
    tool_calls: list[ToolCall]
    usage: Usage | None
    raw: dict[str, Any]

    @classmethod
    def from_json(cls, obj: Json) -> Response:
        texts: list[str] = []
        calls: list[ToolCall] = []
        for item in obj.get("output") or []:
            if not isinstance(item, Mapping):
                continue
            if item.get("type") == "message":
                texts += [str(part.get("text") or "") for part in item.get("content") or []
                          if isinstance(part, Mapping) and part.get("type") == "output_text"]
            elif item.get("type") == "function_call":
                calls.append(ToolCall(str(item.get("call_id") or ""), str(item.get("name") or ""),
                                      str(item.get("arguments") or "")))
        usage = obj.get("usage")
        counts = None
        if isinstance(usage, Mapping):
            details = usage.get("input_tokens_details")
            counts = Usage(_int(usage, "input_tokens"), _int(usage, "output_tokens"), _int(usage, "total_tokens"),
                           _int(details, "cached_tokens") if isinstance(details, Mapping) else 0)
        return cls(str(obj.get("id", "")), str(obj.get("model", "")), str(obj.get("status", "")), "".join(texts),
                   calls, counts, dict(obj))


@dataclass(frozen=True)
class Embeddings:
    """``/v1/embeddings``: one vector per input, in input order, and the input tokens they cost."""

    vectors: list[list[float]]
    model: str
    prompt_tokens: int

    @classmethod
    def from_json(cls, obj: Json) -> Embeddings:
        items = sorted((d for d in obj.get("data") or [] if isinstance(d, Mapping)), key=lambda d: _int(d, "index"))
        vectors = [[float(x) for x in d.get("embedding") or []] for d in items]
        usage = obj.get("usage")
        return cls(vectors, str(obj.get("model", "")), _int(usage, "prompt_tokens") if isinstance(usage, Mapping)
                   else 0)
