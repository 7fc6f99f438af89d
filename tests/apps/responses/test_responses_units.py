"""The Responses translation, assembler and store (bounded, owned), without a server.

The assembler's events are read back by openai-python's own types and its
``responses.stream`` accumulator (``ResponseStreamState``): what a client
rebuilds from the stream must be the response the server sends whole.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from apps.inputs.auth import ApiKeyAuth
from apps.protocol.errors import APIError
from apps.protocol.models import ChatMessage
from apps.responses.output import ResponseAssembler, output_messages
from apps.responses.protocol import ResponsesRequest, to_chat
from apps.responses.service import ResponsesService, rename_error
from apps.responses.store import ResponseStore, StoredResponse
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
    assert store.get("resp_r-1", None) is not None  # now the most recently used
    store.put(StoredResponse({"id": "resp_r-3"}, []))
    assert store.get("resp_r-2", None) is None and len(store) == 2 and store.delete("resp_r-1", None)
    rid = response_id("abc123")
    assert replica_tag(rid) == "abc123" and replica_tag("resp_plain") is None and replica_tag("chatcmpl-1") is None
    # A chain shares its parents' turns; an evicted parent still serves its children's conversation.
    one = StoredResponse({"id": "resp_r-a"}, [ChatMessage(role="user", content="a")])
    two = StoredResponse({"id": "resp_r-b"}, [ChatMessage(role="user", content="b")], one)
    store.put(one)
    store.put(two)
    store.put(StoredResponse({"id": "resp_r-c"}, []))
    assert store.get("resp_r-a", None) is None and [t.content for t in two.conversation()] == ["a", "b"]
    for bad_entries, bad_bytes, param in ((0, 1, "max_stored_responses"), (1, 0, "max_stored_response_bytes")):
        with pytest.raises(InvalidParameterError) as bad:
            ResponseStore(max_entries=bad_entries, max_bytes=bad_bytes)
        assert bad.value.param == param
    service = ResponsesService("here", max_stored=4)
    with pytest.raises(Exception, match="replica there") as other:
        service.lookup(response_id("there"), None)
    assert getattr(other.value, "status", None) == 404


# ------------------------------------------------------------ bounded and owned (Step 29, item 4)
AT_LIMIT: dict[str, Any] = {"metadata": {f"{k:02d}" + "k" * 62: f"{k:02d}" + "v" * 510 for k in range(16)},
                            "user": "u" * 64}


@pytest.mark.parametrize(("extra", "param", "says"), [
    ({"metadata": {str(k): "v" for k in range(17)}}, "metadata", "at most 16 key-value pairs, got 17"),
    ({"metadata": {"k" * 65: "v"}}, "metadata", "is 65 characters; the limit is 64"),
    ({"metadata": {"k": "v" * 513}}, "metadata", "the value of 'k' is 513 characters; the limit is 512"),
    ({"user": "u" * 65}, "user", "65 characters; the limit is 64"),
    # What a 4 MiB body used to keep: ~35 MiB of Python objects per stored response.
    ({"metadata": {str(k): "" for k in range(300_000)}}, "metadata", "at most 16 key-value pairs, got 300000"),
])
def test_metadata_and_user_past_openais_limits_are_refused_by_name(extra: dict[str, Any], param: str,
                                                                   says: str) -> None:
    to_chat(ResponsesRequest.model_validate({"input": "x", **AT_LIMIT}), [])  # the limits themselves pass
    service = ResponsesService("here")
    with pytest.raises(InvalidParameterError) as info:
        service.parse(json.dumps({"input": "x", **extra}).encode(), 8 * 1024 * 1024, None)
    assert info.value.param == param and says in info.value.message, info.value.message


def _stored(rid: str, text: str, parent: StoredResponse | None = None, owner: str | None = None) -> StoredResponse:
    return StoredResponse({"id": rid, "output": [{"type": "message", "content": [{"text": text}]}]},
                          [ChatMessage(role="user", content=text)], parent, owner)


def test_a_stored_responses_size_counts_what_it_holds() -> None:
    small, big = _stored("resp_r-s", "x"), _stored("resp_r-b", "x" * 1_000_000)
    assert 999_999 <= big.size - small.size < 1_000_100  # one copy of the text: the turn and the output share it
    wide = _stored("resp_r-w", "🙂" * 100_000)  # past the BMP: four bytes a character in memory
    assert wide.size - small.size >= 400_000
    meta = StoredResponse({"id": "resp_r-m", **AT_LIMIT}, [])
    assert meta.size >= 16 * (64 + 512) + 64  # every metadata key and value (all distinct), and the user


def test_the_store_is_bounded_by_bytes_counting_parents_its_children_hold() -> None:
    mib = 1024 * 1024
    store = ResponseStore(max_entries=100, max_bytes=7 * mib // 2)
    first = _stored("resp_r-1", "a" * mib)
    second, third = _stored("resp_r-2", "b" * mib, first), _stored("resp_r-3", "c" * mib, first)
    for entry in (first, second, third):
        store.put(entry)
    assert store.num_bytes == first.size + second.size + third.size  # the shared parent counts once
    fourth = _stored("resp_r-4", "d" * mib)
    store.put(fourth)  # 4.2 MiB held: the least recently used go until at most 3.5 MiB is held
    # Evicting the first frees nothing while its children hold it; evicting the second frees only itself.
    assert [store.get(e.id, None) for e in (first, second)] == [None, None]
    assert store.num_bytes == first.size + third.size + fourth.size <= store.max_bytes and len(store) == 2
    store.delete(third.id, None)  # the last child that held the first: both go
    assert store.num_bytes == fourth.size
    store.put(_stored("resp_r-huge", "h" * 4 * mib))  # larger than the bound on its own: nothing keeps it
    assert store.get("resp_r-huge", None) is None and store.num_bytes == 0 and len(store) == 0


def test_a_stored_response_belongs_to_the_key_that_made_it() -> None:
    auth = ApiKeyAuth(["key-one", "key-two"])
    one, two = auth.check("Bearer key-one"), auth.check("Bearer key-two")
    assert one is not None and two is not None and one != two and "key-one" not in one
    assert ApiKeyAuth([]).check(None) is None  # no keys: every caller is the same one
    service = ResponsesService("here")
    made = _stored(response_id("here"), "mine", owner=one)
    service.store.put(made)
    assert service.lookup(made.id, one) is made
    for call in (lambda: service.lookup(made.id, two), lambda: service.delete(made.id, two),
                 lambda: service.parse(json.dumps({"input": "x", "previous_response_id": made.id}).encode(),
                                       1 << 20, two)):
        with pytest.raises(APIError) as info:
            call()
        # The same 404 as an unknown id: another key cannot tell that the response exists.
        assert (info.value.status, info.value.code) == (404, "response_not_found") and made.id in info.value.message
    assert service.parse(json.dumps({"input": "x", "previous_response_id": made.id}).encode(), 1 << 20,
                         one).parent is made
    service.delete(made.id, one)
    assert service.store.get(made.id, one) is None
