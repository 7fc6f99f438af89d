"""The OpenAI wire format: request models (pydantic) and response builders (dicts).

Pure: no Ray, torch or engine. Request models are strict (``"ten"`` is not an
integer, ``1.5`` is not ``n``; integers are accepted where floats are) and
ignore unknown fields, as vLLM does, so that newer clients keep working. Value
ranges are checked by ``SamplingParams`` (see ``apps.inputs.params``), which
names the parameter at fault; only constraints that SamplingParams cannot
express under the right name (``max_tokens`` vs ``max_completion_tokens``,
``top_logprobs``) are declared here.

Fields beyond OpenAI's (``top_k``, ``min_p``, ``repetition_penalty``,
``ignore_eos``, ``stop_token_ids``, ``structured_outputs``) use vLLM's names;
openai-python sends them through ``extra_body``. The shapes of
``response_format``, ``structured_outputs``, ``tools`` and ``tool_choice``
live in ``apps.protocol.tools``.

Response builders return plain JSON-ready dicts that the official ``openai``
types parse (``Completion``, ``ChatCompletion``, ``ChatCompletionChunk``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from apps.protocol.errors import error_response
from apps.protocol.tools import (
    MessageToolCall,
    ResponseFormat,
    StructuredOutputsParams,
    ToolChoice,
    ToolDefinition,
)
from scheduling.batch import TokenLogprobs
from scheduling.sampling_params import MAX_LOGPROBS

SSE_DONE = b"data: [DONE]\n\n"


# ------------------------------------------------------------------ requests
class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    """``stream_options``: with ``include_usage`` a last chunk carries the usage."""

    include_usage: bool | None = False


class TextContentPart(_Strict):
    """One OpenAI content part; only ``{"type": "text", "text": ...}`` is served."""

    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    """One chat turn. ``content`` may be null only on assistant turns (e.g. one that made ``tool_calls``).

    A ``tool`` turn answers the call ``tool_call_id`` of an earlier assistant turn.
    """

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None


class _GenerationRequest(_Strict):
    """Fields shared by completions and chat completions (null means the default)."""

    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    # vLLM-style extensions (openai-python: extra_body={...}).
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    logit_bias: dict[str, float] | None = None  # token id (a JSON key, so a string) -> bias in [-100, 100]
    # Structured output (apps.inputs.structured): OpenAI's response_format, or vLLM's structured_outputs.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return value

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk (``stream_options.include_usage``)."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_GenerationRequest):
    """``POST /v1/completions``. A prompt or a batch of them (see ``completion_prompts``)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None


class ChatCompletionRequest(_GenerationRequest):
    """``POST /v1/chat/completions``. ``max_completion_tokens`` wins over ``max_tokens``."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None  # default: "auto" with tools, else "none" (apps.tools.choice)

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs to be true")
        return value


# ----------------------------------------------------------------- responses
def usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int = 0) -> dict[str, Any]:
    """The ``usage`` object; cached prompt tokens go in ``prompt_tokens_details``."""
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
    }


Decode = Callable[[int], str]
TokenBytes = Callable[[int], bytes]
MIN_LOGPROB = -9999.0  # stands in for -inf (a masked token): JSON has no infinities


def _finite(logprob: float) -> float:
    return logprob if logprob >= MIN_LOGPROB else MIN_LOGPROB  # NaN compares false: clamped too


def completion_logprobs(
    entries: Sequence[TokenLogprobs], decode: Decode, offsets: Sequence[int]
) -> dict[str, Any]:
    """Legacy completions logprobs: parallel lists; ``offsets[i]`` is where token i starts in the text.

    ``decode`` turns one token id into its text. The offsets index the text
    the response carries (``ResponseBuilder`` tracks it), not the sum of
    per-token decodes: a token holding half a character decodes to U+FFFD.
    Several alternatives that decode to the same text keep the most likely
    one (a dict cannot hold both).
    """
    assert len(offsets) == len(entries), (len(offsets), len(entries))
    top: list[dict[str, float]] = []
    for e in entries:
        alts: dict[str, float] = {}
        for tid, lp in zip(e.top_token_ids, e.top_logprobs, strict=True):
            alts.setdefault(decode(tid), _finite(lp))
        top.append(alts)
    return {
        "tokens": [decode(e.token_id) for e in entries],
        "token_logprobs": [_finite(e.logprob) for e in entries],
        "top_logprobs": top,
        "text_offset": list(offsets),
    }


def _token_logprob(token_id: int, logprob: float, decode: Decode, token_bytes: TokenBytes) -> dict[str, Any]:
    return {"token": decode(token_id), "logprob": _finite(logprob), "bytes": list(token_bytes(token_id))}


def chat_logprobs(entries: Sequence[TokenLogprobs], decode: Decode, token_bytes: TokenBytes) -> dict[str, Any]:
    """Chat logprobs: ``{"content": [{token, logprob, bytes, top_logprobs}], "refusal": null}``.

    ``bytes`` are the token's own (``token_bytes``), so a client joining them
    gets the text back even where a token holds part of a character.
    """
    content = []
    for e in entries:
        item = _token_logprob(e.token_id, e.logprob, decode, token_bytes)
        item["top_logprobs"] = [
            _token_logprob(t, lp, decode, token_bytes) for t, lp in zip(e.top_token_ids, e.top_logprobs, strict=True)
        ]
        content.append(item)
    return {"content": content, "refusal": None}


def completion_choice(
    index: int, text: str, finish_reason: str | None, logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One completions choice (also the choice of a streaming chunk)."""
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_choice(
    index: int, text: str | None, finish_reason: str | None, logprobs: dict[str, Any] | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One non-streaming chat choice: the assistant message (``content`` null when only tools were called)."""
    message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_delta_choice(
    index: int,
    text: str | None,
    finish_reason: str | None = None,
    logprobs: dict[str, Any] | None = None,
    *,
    role: bool = False,
    tool_calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One streaming chat choice; ``role=True`` on a sequence's first chunk; ``tool_calls`` as call deltas."""
    delta: dict[str, Any] = {"role": "assistant"} if role else {}
    if text is not None:
        delta["content"] = text
    if tool_calls:
        delta["tool_calls"] = tool_calls
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def _envelope(
    obj: str, request_id: str, model: str, created: int, choices: list[dict[str, Any]],
    usage_obj: dict[str, Any] | None,
) -> dict[str, Any]:
    return {
        "id": request_id, "object": obj, "created": created, "model": model,
        "choices": choices, "usage": usage_obj,
    }


def completion_response(
    request_id: str, model: str, created: int, choices: list[dict[str, Any]], usage_obj: dict[str, Any]
) -> dict[str, Any]:
    """A whole ``text_completion`` object."""
    return _envelope("text_completion", request_id, model, created, choices, usage_obj)


def completion_chunk(
    request_id: str, model: str, created: int, choices: list[dict[str, Any]],
    usage_obj: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One streaming completions chunk (OpenAI reuses ``text_completion``)."""
    return _envelope("text_completion", request_id, model, created, choices, usage_obj)


def chat_completion_response(
    request_id: str, model: str, created: int, choices: list[dict[str, Any]], usage_obj: dict[str, Any]
) -> dict[str, Any]:
    """A whole ``chat.completion`` object."""
    return _envelope("chat.completion", request_id, model, created, choices, usage_obj)


def chat_completion_chunk(
    request_id: str, model: str, created: int, choices: list[dict[str, Any]],
    usage_obj: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One ``chat.completion.chunk``."""
    return _envelope("chat.completion.chunk", request_id, model, created, choices, usage_obj)


# ----------------------------------------------------------------------- SSE
def sse_event(obj: Mapping[str, Any] | BaseModel) -> bytes:
    """One server-sent event: ``data: {json}\\n\\n``."""
    data = obj.model_dump(mode="json") if isinstance(obj, BaseModel) else obj
    return b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def sse_error_event(exc: BaseException) -> bytes:
    """The error envelope as a data event, for failures after the stream has begun."""
    _, body = error_response(exc)
    return sse_event(body)
