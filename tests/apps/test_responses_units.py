"""The Responses translation, assembler and store, without a server.

The assembler's events are read back by openai-python's own types and its
``responses.stream`` accumulator (``ResponseStreamState``): what a client
rebuilds from the stream must be the response the server sends whole.
"""

from __future__ import annotations

from typing import Any

import pytest
from openai import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from apps.protocol import ChatMessage
from apps.responses_output import ResponseAssembler, ResponseStore, StoredResponse, output_messages
from apps.responses_protocol import ResponsesRequest, to_chat
from apps.responses_service import ResponsesService, rename_error
from cluster.response_ids import replica_tag, response_id
from scheduling.errors import InvalidParameterError

EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)


def _chunk(content: str | None = None, calls: list[dict[str, Any]] | None = None,
           finish: str | None = None) -> dict[str, Any]:
    delta: dict[str, Any] = {}
    if content is not None:
        delta["content"] = content
    if calls:
        delta["tool_calls"] = calls
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def _skeleton(rid: str = "resp_r-1") -> dict[str, Any]:
    return {"id": rid, "object": "response", "created_at": 1, "model": "m", "parallel_tool_calls": True,
            "tool_choice": "auto", "tools": []}


CHUNKS = [
    _chunk("Let me "), _chunk("check."),
    _chunk(calls=[{"index": 0, "id": "call_a", "type": "function", "function": {"name": "f", "arguments": ""}}]),
    _chunk(calls=[{"index": 0, "function": {"arguments": '{"x": '}}]),
    _chunk(calls=[{"index": 0, "function": {"arguments": "1}"}}]),
    _chunk(calls=[{"index": 1, "id": "call_b", "type": "function", "function": {"name": "g", "arguments": "{}"}}],
           finish="tool_calls"),
]


@pytest.mark.parametrize("cut", [False, True])
def test_events_rebuild_the_whole_response_in_the_clients_accumulator(cut: bool) -> None:
    asm = ResponseAssembler(_skeleton())
    raw = asm.start()
    chunks = CHUNKS[:2] + [_chunk(finish="length")] if cut else CHUNKS
    for chunk in chunks:
        raw += asm.feed(chunk)
    usage = {"input_tokens": 3, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
             "output_tokens": 5, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 8}
    raw += asm.finish(usage)
    events = [EVENTS.validate_python(e) for e in raw]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    state: ResponseStreamState[Any] = ResponseStreamState(input_tools=omit, text_format=omit)
    for event in events:
        state.handle_event(event)  # raises on an event out of order or an item whose identity changed
    whole = Response.model_validate(asm.response())
    assert whole.output_text == "Let me check."
    if cut:
        assert events[-1].type == "response.incomplete" and whole.status == "incomplete"
        assert whole.incomplete_details is not None and whole.incomplete_details.reason == "max_output_tokens"
        return
    assert events[-1].type == "response.completed" and whole.status == "completed"
    final = state._completed_response  # what the helper's get_final_response() returns
    assert final is not None and final.output_text == whole.output_text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    calls = [(o.call_id, o.name, o.arguments) for o in whole.output if o.type == "function_call"]
    assert calls == [("call_a", "f", '{"x": 1}'), ("call_b", "g", "{}")]
    streamed: dict[str, str] = {}
    for e in events:
        if e.type == "response.function_call_arguments.delta":
            streamed[e.item_id] = streamed.get(e.item_id, "") + e.delta
    assert list(streamed.values()) == ['{"x": 1}', "{}"]
    # The conversation continues with the text turn, then one assistant turn holding both calls.
    turns = output_messages(asm.response()["output"])
    assert [t.role for t in turns] == ["assistant", "assistant"]
    assert turns[0].content == "Let me check." and [c.id for c in turns[1].tool_calls or []] == ["call_a", "call_b"]


def test_a_failure_mid_stream_ends_with_error_and_failed_events() -> None:
    asm = ResponseAssembler(_skeleton())
    raw = asm.start() + asm.feed(_chunk("hi"))
    raw += asm.fail({"message": "the engine failed", "code": None, "param": None})
    events = [EVENTS.validate_python(e) for e in raw]
    assert [e.type for e in events[-2:]] == ["error", "response.failed"]
    assert events[-1].response.error is not None and events[-1].response.status == "failed"


def test_translation_keeps_turn_order_and_maps_the_fields() -> None:
    req = ResponsesRequest.model_validate({
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text",
                                                                                   "text": "b"}]},
                  {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                  {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"},
                  {"type": "function_call_output", "call_id": "c1", "output": "one"}],
        "instructions": "sys", "max_output_tokens": 7, "tool_choice": {"type": "function", "name": "f"},
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}, "strict": True}}})
    history = [ChatMessage(role="user", content="before")]
    chat = to_chat(req, history)
    assert [(m.role, m.content) for m in chat.messages] == [
        ("system", "sys"), ("user", "before"), ("user", "a\nb"), ("assistant", None), ("tool", "one")]
    assert [c.id for c in chat.messages[3].tool_calls or []] == ["c1", "c2"]
    assert chat.max_completion_tokens == 7
    assert chat.tool_choice is not None and not isinstance(chat.tool_choice, str)
    assert chat.tool_choice.function.name == "f"
    assert chat.tools is not None and chat.tools[0].function.name == "f"
    assert chat.response_format is not None and chat.response_format.type == "json_schema"


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "reasoning": {"effort": "low"}}, "reasoning"),
    ({"input": "x", "parallel_tool_calls": False}, "parallel_tool_calls"),
    ({"input": "x", "include": ["message.output_text.logprobs"]}, "include"),
    ({"input": []}, "input"),
])
def test_options_that_cannot_be_honoured_are_refused_by_name(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidParameterError) as info:
        to_chat(ResponsesRequest.model_validate(body), [])
    assert info.value.param == param


def test_chat_field_names_in_errors_become_the_responses_names() -> None:
    renamed = rename_error(InvalidParameterError("max_completion_tokens", "max_completion_tokens (9) is too many"))
    assert isinstance(renamed, InvalidParameterError)
    assert (renamed.param, renamed.message) == ("max_output_tokens", "max_output_tokens (9) is too many")
    same = InvalidParameterError("temperature", "bad")
    assert rename_error(same) is same


def test_the_store_is_bounded_and_ids_name_their_replica() -> None:
    store = ResponseStore(max_entries=2)
    for rid in ("resp_r-1", "resp_r-2"):
        store.put(StoredResponse({"id": rid}, []))
    assert store.get("resp_r-1") is not None  # now the most recently used
    store.put(StoredResponse({"id": "resp_r-3"}, []))
    assert store.get("resp_r-2") is None and len(store) == 2 and store.delete("resp_r-1")
    rid = response_id("abc123")
    assert replica_tag(rid) == "abc123" and replica_tag("resp_plain") is None and replica_tag("chatcmpl-1") is None
    # A chain shares its parents' turns; an evicted parent still serves its children's conversation.
    one = StoredResponse({"id": "resp_r-a"}, [ChatMessage(role="user", content="a")])
    two = StoredResponse({"id": "resp_r-b"}, [ChatMessage(role="user", content="b")], one)
    store.put(one)
    store.put(two)
    store.put(StoredResponse({"id": "resp_r-c"}, []))
    assert store.get("resp_r-a") is None and [t.content for t in two.conversation()] == ["a", "b"]
    with pytest.raises(InvalidParameterError) as bad:
        ResponseStore(max_entries=0)
    assert bad.value.param == "max_stored_responses"
    service = ResponsesService("here", max_stored=4)
    with pytest.raises(Exception, match="replica there") as other:
        service.lookup(response_id("there"))
    assert getattr(other.value, "status", None) == 404
