"""Chat completion chunks -> Responses API events and the ``response`` object; the per-replica response store.

``ResponseAssembler`` reads the chat chunks ``apps.outputs.response_builder``
streams for the translated request (``apps.responses.protocol``) and builds
the output items OpenAI's Responses API has: a ``message`` item (one
``output_text`` part) for text, a ``function_call`` item per tool call, in
the order the model wrote them. Streaming and non-streaming responses come
from the same assembler (a non-streamed one drops the events), so both carry
the same output by construction.

Events, each with a ``sequence_number`` counting from 0: ``response.created``
and ``response.in_progress`` first; per item ``response.output_item.added``,
then for a message ``response.content_part.added``, ``response.output_text.delta``
..., ``response.output_text.done``, ``response.content_part.done``, and for a
call ``response.function_call_arguments.delta`` ... ``.done``; then
``response.output_item.done``. The last is ``response.completed`` (or
``response.incomplete`` when ``max_output_tokens`` cut it short, or ``error``
and ``response.failed`` when the engine failed). openai-python's
``responses.stream`` helper checks this order.

The store of finished responses is ``apps.responses.store``'s.
"""

from __future__ import annotations

import copy
import uuid
from typing import Any

from actors.api import FinishReason
from apps.protocol.models import ChatMessage


def responses_usage(num_prompt: int, num_completion: int, num_cached: int) -> dict[str, Any]:
    """The Responses ``usage`` object (input/output tokens, not prompt/completion)."""
    return {"input_tokens": num_prompt,
            "input_tokens_details": {"cached_tokens": num_cached, "cache_write_tokens": 0},
            "output_tokens": num_completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": num_prompt + num_completion}


class ResponseAssembler:
    """One response's output items and events, fed chat chunks (``feed``) then ended (``finish``/``fail``).

    ``skeleton`` holds the response's fixed fields (id, model, the request's
    echoed options); the assembler adds ``status``, ``output``, ``usage``
    and ``incomplete_details``.
    """

    def __init__(self, skeleton: dict[str, Any]) -> None:
        self.skeleton = skeleton
        self.output: list[dict[str, Any]] = []
        self._seq = 0
        self._open: int | None = None  # output index of the item still being written
        self._calls: dict[int, int] = {}  # chat tool-call index -> output index
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.status = "in_progress"

    @property
    def id(self) -> str:
        return str(self.skeleton["id"])

    def response(self) -> dict[str, Any]:
        """The ``response`` object as it stands (a copy: events must not share the assembler's items)."""
        out = {**self.skeleton, "status": self.status, "output": copy.deepcopy(self.output), "usage": self.usage}
        out["incomplete_details"] = ({"reason": "max_output_tokens"} if self.status == "incomplete" else None)
        return out

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def start(self) -> list[dict[str, Any]]:
        """The opening events."""
        return [self._event("response.created", response=self.response()),
                self._event("response.in_progress", response=self.response())]

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """The events of one chat chunk (one choice: Responses has no ``n``)."""
        events: list[dict[str, Any]] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                events += self._text(delta["content"])
            for call in delta.get("tool_calls") or []:
                events += self._call(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return events

    def _text(self, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        item = None if self._open is None else self.output[self._open]
        if item is None or item["type"] != "message":
            events += self._close()
            item = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "status": "in_progress",
                    "role": "assistant", "content": []}
            events += self._add(item)
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item["content"].append(part)
            events.append(self._event("response.content_part.added", item_id=item["id"], output_index=self._open,
                                      content_index=0, part=copy.deepcopy(part)))
        item["content"][0]["text"] += text
        events.append(self._event("response.output_text.delta", item_id=item["id"], output_index=self._open,
                                  content_index=0, delta=text, logprobs=[]))
        return events

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        function = call.get("function") or {}
        if "id" in call:  # a call opens: its own item
            events += self._close()
            item = {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": "in_progress",
                    "call_id": call["id"], "name": function.get("name", ""), "arguments": ""}
            events += self._add(item)
            self._calls[call["index"]] = len(self.output) - 1
        arguments = function.get("arguments") or ""
        if arguments:
            index = self._calls[call["index"]]
            item = self.output[index]
            item["arguments"] += arguments
            events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=index, delta=arguments))
        return events

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.output.append(item)
        self._open = len(self.output) - 1
        return [self._event("response.output_item.added", output_index=self._open, item=copy.deepcopy(item))]

    def _close(self, status: str = "completed") -> list[dict[str, Any]]:
        """The done events of the open item, if any."""
        if self._open is None:
            return []
        index, self._open = self._open, None
        item = self.output[index]
        item["status"] = status
        events: list[dict[str, Any]] = []
        if item["type"] == "message":
            part = item["content"][0]
            events.append(self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                      content_index=0, text=part["text"], logprobs=[]))
            events.append(self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                      content_index=0, part=copy.deepcopy(part)))
        else:
            events.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=index, arguments=item["arguments"], name=item["name"]))
        events.append(self._event("response.output_item.done", output_index=index, item=copy.deepcopy(item)))
        return events

    def finish(self, usage: dict[str, Any]) -> list[dict[str, Any]]:
        """The closing events; the response is complete (or incomplete: cut at ``max_output_tokens``)."""
        cut = self.finish_reason == FinishReason.LENGTH  # the wire string, read from the chat choice
        events = self._close("incomplete" if cut else "completed")
        self.status, self.usage = ("incomplete" if cut else "completed"), usage
        events.append(self._event("response.incomplete" if cut else "response.completed", response=self.response()))
        return events

    def fail(self, error: dict[str, Any]) -> list[dict[str, Any]]:
        """The events of a failure mid-stream: ``error`` (the OpenAI error body's fields), ``response.failed``."""
        self._open = None
        self.status = "failed"
        failed = self.response()
        failed["error"] = {"code": error.get("code") or "server_error", "message": error.get("message", "")}
        return [self._event("error", code=error.get("code"), message=error.get("message", ""),
                            param=error.get("param")),
                self._event("response.failed", response=failed)]


def output_messages(output: list[dict[str, Any]]) -> list[ChatMessage]:
    """A response's output items as the chat turns that continue the conversation."""
    turns: list[ChatMessage] = []
    calls: list[dict[str, Any]] = []
    for item in output:
        if item["type"] == "message":
            text = "".join(part["text"] for part in item["content"] if part["type"] == "output_text")
            turns.append(ChatMessage(role="assistant", content=text))
        elif item["type"] == "function_call":
            calls.append({"id": item["call_id"], "type": "function",
                          "function": {"name": item["name"], "arguments": item["arguments"]}})
    if calls:
        turns.append(ChatMessage.model_validate({"role": "assistant", "tool_calls": calls}))
    return turns
