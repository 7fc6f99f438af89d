"""Tool-call events (``apps.tools.scanners``) -> the streamed chat choices OpenAI sends, and the finish reason.

A call's opening delta ``{"index", "id", "type": "function", "function":
{"name", "arguments": ""}}`` travels in a chunk of its own; the pieces of its
arguments follow as ``{"index", "function": {"arguments": piece}}``, joined
per call within a chunk. Content between calls keeps its order. This is the
shape openai-python's stream accumulation (and most agent loops) expect.
"""

from __future__ import annotations

from typing import Any

from actors.api import FinishReason
from apps.protocol import models as p
from apps.tools.scanners import ToolCallDelta, ToolEvent


def finish_reason(engine_reason: FinishReason | None, called: bool) -> str | None:
    """The wire's finish reason: the engine's, except that a choice that called a tool and stopped normally says
    "tool_calls" (OpenAI's word, never the engine's: it is decided here, from the choice's text)."""
    if engine_reason is None:
        return None
    return "tool_calls" if called and engine_reason is FinishReason.STOP else engine_reason.value


def call_delta(delta: ToolCallDelta) -> dict[str, Any]:
    """One entry of a chunk's ``delta.tool_calls``."""
    if delta.opens:
        return {"index": delta.index, "id": delta.id, "type": "function",
                "function": {"name": delta.name, "arguments": delta.arguments}}
    return {"index": delta.index, "function": {"arguments": delta.arguments}}


def chunk_deltas(index: int, events: list[ToolEvent], finish: str | None, logprobs: dict[str, Any] | None,
                 *, has_tokens: bool) -> list[dict[str, Any]]:
    """The streamed choices (``chat_delta_choice``) of choice ``index``'s new ``events``, in order.

    The last one carries ``finish`` and ``logprobs``; with no events, one
    carries them alone if there is a finish or ``has_tokens`` (tokens whose
    text the scanner still holds).
    """
    out: list[dict[str, Any]] = []
    content: list[str] = []
    calls: dict[int, str] = {}  # call index -> arguments gathered since the last flush

    def flush() -> None:
        if content or calls:
            deltas = [call_delta(ToolCallDelta(i, arguments)) for i, arguments in calls.items()]
            out.append(p.chat_delta_choice(index, "".join(content) if content else None, tool_calls=deltas))
            content.clear()
            calls.clear()

    for event in events:
        if isinstance(event, str):
            content.append(event)
        elif event.opens:
            flush()
            out.append(p.chat_delta_choice(index, None, tool_calls=[call_delta(event)]))
        else:
            calls[event.index] = calls.get(event.index, "") + event.arguments
    flush()
    if not out:
        if finish is None and not has_tokens:
            return []
        out.append(p.chat_delta_choice(index, None))
    out[-1]["finish_reason"], out[-1]["logprobs"] = finish, logprobs
    return out
