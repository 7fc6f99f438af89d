"""Chat messages -> the conversation a chat template renders, with tool calls, tool results and offered tools.

Two cases, chosen by whether the tokenizer's chat template knows tools
(``actors.tokenizing.template_supports_tools``):

- It does: turns keep their structure (an assistant turn's ``tool_calls``
  with arguments as objects, as Hugging Face templates expect; ``tool`` turns
  with ``tool_call_id``) and the offered tools go to the template as ``tools``.
- It does not (plain ChatML, the tiny model, SmolLM2): everything becomes
  text in the Hermes convention the ``auto`` parser reads back: an assistant's
  calls are ``<tool_call>`` blocks in its content, a run of tool results is
  one user turn of ``<tool_response>`` blocks, and a system message (joined
  to the conversation's own, if it opens with one) lists the offered tools and
  says how to answer.
"""

from __future__ import annotations

import json
from typing import Any

from apps.protocol.models import ChatMessage
from apps.tools.choice import ToolMode, ToolPlan
from scheduling.errors import InvalidParameterError

Turn = dict[str, Any]

_ANSWER = {
    ToolMode.AUTO: (
        "To call functions, reply with one block per call:\n<tool_call>\n"
        "{\"name\": <function name>, \"arguments\": <arguments as a JSON object>}\n</tool_call>\n"
        "To answer without calling a function, reply in plain text."
    ),
    ToolMode.REQUIRED: (
        "Reply with only a JSON array of the calls to make, each "
        "{\"name\": <function name>, \"arguments\": <arguments as a JSON object>}."
    ),
}


def tools_system_text(plan: ToolPlan) -> str:
    """The system text that offers ``plan``'s tools to a model whose template does not know tools."""
    listed = "\n".join(json.dumps(fn.as_tool(), ensure_ascii=False) for fn in plan.offered)
    if plan.mode is ToolMode.NAMED:
        answer = f"Call the function {plan.named}: reply with only its arguments, as a JSON object."
    else:
        answer = _ANSWER[plan.mode]
    return ("# Tools\n\nYou can call these functions (each with the JSON schema of its arguments):\n"
            f"{listed}\n\n{answer}")


def _text(i: int, msg: ChatMessage) -> str:
    if msg.content is None:
        if msg.role != "assistant":
            raise InvalidParameterError("messages", f"messages[{i}].content is required for role {msg.role!r}")
        return ""
    if isinstance(msg.content, list):
        return "\n".join(part.text for part in msg.content)
    return msg.content


def _arguments(text: str) -> Any:
    """A past call's arguments as the object a template expects (JSON text that is not one stays text)."""
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return text


def _structured(i: int, msg: ChatMessage) -> Turn:
    turn: Turn = {"role": msg.role, "content": _text(i, msg)}
    if msg.name is not None:
        turn["name"] = msg.name
    if msg.tool_calls:
        turn["tool_calls"] = [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": _arguments(call.function.arguments)}}
            for call in msg.tool_calls
        ]
    if msg.tool_call_id is not None:
        turn["tool_call_id"] = msg.tool_call_id
    return turn


def _as_text(i: int, msg: ChatMessage) -> Turn:
    text = _text(i, msg)
    if msg.role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{text}\n</tool_response>"}
    blocks = [json.dumps({"name": call.function.name, "arguments": _arguments(call.function.arguments)},
                         ensure_ascii=False) for call in msg.tool_calls or []]
    content = "\n".join([text] * bool(text) + [f"<tool_call>\n{b}\n</tool_call>" for b in blocks])
    turn: Turn = {"role": msg.role, "content": content}
    if msg.name is not None:
        turn["name"] = msg.name
    return turn


def conversation(messages: list[ChatMessage], plan: ToolPlan, *, template_tools: bool) -> list[Turn]:
    """The turns for the chat template (see the module docstring for the two cases)."""
    if not messages:
        raise InvalidParameterError("messages", "at least one message is required")
    if template_tools:
        return [_structured(i, msg) for i, msg in enumerate(messages)]
    turns: list[Turn] = []
    for i, msg in enumerate(messages):
        turn = _as_text(i, msg)
        if msg.role == "tool" and i > 0 and messages[i - 1].role == "tool":  # one user turn per run of results
            turns[-1]["content"] += "\n" + turn["content"]
        else:
            turns.append(turn)
    if plan.active:
        offer = tools_system_text(plan)
        if turns[0]["role"] == "system":
            turns[0]["content"] = f"{turns[0]['content']}\n\n{offer}" if turns[0]["content"] else offer
        else:
            turns.insert(0, {"role": "system", "content": offer})
    return turns


def offered_tools(plan: ToolPlan) -> list[dict[str, Any]] | None:
    """The ``tools`` to hand a template that knows tools: the offered ones, or None when none are."""
    return [fn.as_tool() for fn in plan.offered] if plan.active else None

