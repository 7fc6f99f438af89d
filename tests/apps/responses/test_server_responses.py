"""``/v1/responses`` over live HTTP with the official ``openai`` client (the tiny model, greedy).

The tiny model's weights are random: what it says is noise, so each check
compares two ways of asking the same thing (the Responses request against
the chat request it translates to, streamed against whole, a conversation
continued by ``previous_response_id`` against the whole history sent again),
or validates what a constraint guarantees (a JSON schema, a forced tool's
arguments). Streams are read by openai-python's own ``responses.stream``
helper, which checks the events' order and identities.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx2
import jsonschema
import openai
import pytest

from cluster.response_ids import replica_tag
from flotilla import Client
from tests.serve_harness import ENGINE, TIMEOUT, LiveServer, app_beside, http

pytestmark = pytest.mark.ray  # on the session's shared cluster: run with the other Ray modules, last (tests/conftest.py)

FLAG = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
        "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}, "rain": {"type": "boolean"}},
           "required": ["unit", "rain"], "additionalProperties": False}
TOOLS: list[Any] = [
    {"type": "function", "name": "get_weather", "description": "Today's weather", "parameters": WEATHER},
    {"type": "function", "name": "ping", "parameters": {"type": "object", "properties": {}}},
]
FORCED = {"type": "function", "name": "get_weather"}
GREEDY: dict[str, Any] = {"model": "tiny", "temperature": 0}
# A string of at least 1,500 characters: the grammar forbids the end of the reply for 1,500+ tokens.
LONG_STORY = {"type": "object", "properties": {"story": {"type": "string", "minLength": 1500}}, "required": ["story"],
              "additionalProperties": False}
MAX_FIRST_TURNS = 40  # with two replicas p2c misses one 40 times in a row with odds 2^-39


def _create(client: openai.OpenAI, **kwargs: Any) -> Any:
    """``responses.create`` with plain-dict arguments (the SDK's TypedDicts are not the point here)."""
    return client.responses.create(**kwargs)


def _stream(client: openai.OpenAI, **kwargs: Any) -> tuple[list[Any], Any]:
    """Every event of a streamed response, and the helper's final response."""
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        return events, stream.get_final_response()


def test_a_plain_response_is_the_chat_reply_it_translates_to(client: openai.OpenAI) -> None:
    resp = _create(client, input="Once upon a time", instructions="Tell a story.", max_output_tokens=12, **GREEDY)
    chat = client.chat.completions.create(
        messages=[{"role": "system", "content": "Tell a story."}, {"role": "user", "content": "Once upon a time"}],
        max_completion_tokens=12, **GREEDY)
    assert resp.output_text == chat.choices[0].message.content
    assert resp.id.startswith("resp_") and resp.object == "response" and resp.model == "tiny"
    assert chat.usage is not None and resp.usage is not None
    assert (resp.usage.input_tokens, resp.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                   chat.usage.completion_tokens)
    cut = chat.choices[0].finish_reason == "length"
    assert resp.status == ("incomplete" if cut else "completed")
    assert (resp.incomplete_details is not None) == cut


def test_the_stream_helper_rebuilds_the_whole_response(client: openai.OpenAI, live: LiveServer) -> None:
    ask: dict[str, Any] = {"input": "Is it sunny?", "max_output_tokens": 60,
                           "text": {"format": {"type": "json_schema", "name": "flag", "schema": FLAG}}, **GREEDY}
    whole = _create(client, **ask)
    events, final = _stream(client, **ask)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text
    jsonschema.validate(json.loads(whole.output_text), FLAG)
    assert final.id != whole.id  # cached tokens may differ: the second ask hits the prefix cache
    assert (final.usage.input_tokens, final.usage.output_tokens) == (whole.usage.input_tokens,
                                                                     whole.usage.output_tokens)
    live.assert_pages_free()


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_tool_is_one_call_with_valid_arguments(client: openai.OpenAI, stream: bool) -> None:
    ask: dict[str, Any] = {"input": "What is the weather in Paris?", "tools": TOOLS, "tool_choice": FORCED,
                           "max_output_tokens": 60, **GREEDY}
    resp = _stream(client, **ask)[1] if stream else _create(client, **ask)
    [call] = resp.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    if stream:  # the streamed call is the whole one
        assert call.arguments == _create(client, **ask).output[0].arguments


def test_previous_response_id_continues_as_the_whole_history_would(client: openai.OpenAI) -> None:
    first = _create(client, input="Hello there", instructions="Be brief.", max_output_tokens=8, **GREEDY)
    second = _create(client, input="And then?", previous_response_id=first.id, max_output_tokens=8, **GREEDY)
    history = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "And then?"}]
    again = _create(client, input=history, max_output_tokens=8, **GREEDY)  # instructions are not carried over
    assert second.output_text == again.output_text
    assert second.usage.input_tokens == again.usage.input_tokens
    assert second.previous_response_id == first.id


def test_a_tool_result_continues_the_conversation(client: openai.OpenAI) -> None:
    called = _create(client, input="Weather?", tools=TOOLS, tool_choice=FORCED, max_output_tokens=60, **GREEDY)
    [call] = called.output
    answer = [{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    chained = _create(client, input=answer, previous_response_id=called.id, tools=TOOLS, max_output_tokens=6,
                      **GREEDY)
    explicit = [{"role": "user", "content": "Weather?"},
                {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
                *answer]
    assert chained.output_text == _create(client, input=explicit, tools=TOOLS, max_output_tokens=6,
                                          **GREEDY).output_text


def test_stored_responses_are_read_deleted_and_not_kept_when_store_is_false(
        client: openai.OpenAI, live: LiveServer) -> None:
    kept = _create(client, input="Remember me", max_output_tokens=4, **GREEDY)
    assert client.responses.retrieve(kept.id).output_text == kept.output_text
    client.responses.delete(kept.id)
    for rid in (kept.id, _create(client, input="Forget me", max_output_tokens=4, store=False, **GREEDY).id):
        status, body = http(f"{live.url}/v1/responses/{rid}")
        assert status == 404 and rid in body["error"]["message"], body
    status, body = http(f"{live.url}/v1/responses", {"input": "Go on", "previous_response_id": kept.id})
    assert status == 404 and body["error"]["param"] == "previous_response_id" and kept.id in body["error"]["message"]
    status, body = http(f"{live.url}/v1/responses/resp_elsewhere-0123", method="DELETE")
    assert status == 404 and "replica elsewhere" in body["error"]["message"], body
    live.assert_pages_free()


def test_a_client_gone_mid_stream_frees_every_page(live: LiveServer) -> None:
    steps_before = live.stats().num_steps
    body = {"input": "Tell a long story", "max_output_tokens": 1900, "stream": True,
            "text": {"format": {"type": "json_schema", "name": "story", "schema": LONG_STORY}}, **GREEDY}
    with httpx2.Client(timeout=TIMEOUT) as web, web.stream("POST", f"{live.url}/v1/responses", json=body) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line == "event: response.output_text.delta":
                break  # the reply is being written: now hang up
        assert live.stats().num_unfinished_requests == 1  # mid-stream: the grammar keeps it going 1,500+ steps
    live.assert_pages_free(10.0)
    steps = live.stats().num_steps - steps_before
    assert steps < 1000, f"{steps} steps ran: the request was not aborted on disconnect"
    status, answer = http(f"{live.url}/v1/responses", {"input": "hi", "max_output_tokens": 2, **GREEDY})
    assert status == 200 and answer["status"] in ("completed", "incomplete"), answer


@pytest.mark.parametrize(("body", "param"), [
    ({"input": []}, "input"),
    ({"input": ""}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://127.0.0.1/x.png"}]}]},
     "input"),
    ({"input": [{"type": "web_search_call", "id": "x"}]}, "input"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": 100_000}, "max_output_tokens"),
    ({"input": "hi", "temperature": -1}, "temperature"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "truncation": "auto"}, "truncation"),
    ({"model": "nope", "input": "hi"}, "model"),
    ({"input": "hi", "metadata": {str(k): "v" for k in range(17)}}, "metadata"),
    ({"input": "hi", "metadata": {"k": "v" * 513}}, "metadata"),
    ({"input": "hi", "user": "u" * 65}, "user"),
])
def test_bad_requests_are_400s_naming_the_field(live: LiveServer, body: dict[str, Any], param: str) -> None:
    status, reply = http(f"{live.url}/v1/responses", body)
    assert status == (404 if param == "model" else 400), reply
    assert reply["error"]["param"] == param, reply
    live.assert_pages_free()


def test_continuations_and_reads_reach_the_replica_that_holds_the_response(
        live: LiveServer, tiny_model_dir: Path) -> None:
    """Two replicas behind the prefix router: the SDK's header and the GET path route to the id's replica."""
    args = {**ENGINE, "model": str(tiny_model_dir), "served_model_name": "tiny", "num_replicas": 2,
            "request_router": "prefix", "scheduler_placement": "replica"}
    with app_beside(live, args, "two-replicas", None) as server, Client(server.url) as sdk:
        made: dict[str, list[str]] = {}
        for i in range(MAX_FIRST_TURNS):  # p2c spreads them; stop once both replicas hold some
            first = sdk.responses(f"Turn {i}", max_output_tokens=2, temperature=0)
            made.setdefault(str(replica_tag(first.id)), []).append(first.id)
            if len(made) == 2:
                break
        assert len(made) == 2, made
        for ids in made.values():
            for rid in ids:
                assert sdk.responses("Go on", previous_response_id=rid, max_output_tokens=2).status
                status, body = http(f"{server.url}/v1/responses/{rid}")
                assert status == 200 and body["id"] == rid, body
        other = {tag: ids[0] for tag, ids in made.items()}
        # Without the header a continuation may land on the other replica: then it is refused, naming the holder.
        for tag, rid in other.items():
            status, body = http(f"{server.url}/v1/responses", {"input": "x", "previous_response_id": rid,
                                                                "max_output_tokens": 1})
            assert status == 200 or (body["error"]["code"] == "response_on_other_replica"
                                     and f"replica {tag}" in body["error"]["message"]), body
