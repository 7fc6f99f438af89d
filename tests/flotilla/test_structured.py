"""Structured output and tool calling in the SDK, against the scripted fake server.

Request fields pass through as sent; tool calls are read from replies and
joined from stream fragments as the openai client joins them; ``parse`` sends
a json_schema response_format and validates the reply (pydantic or jsonschema).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from pydantic import BaseModel, ValidationError

import flotilla
from flotilla import AsyncClient, Client, StructuredOutputError, ToolCall
from tests.flotilla.fake_server import (
    FakeServer,
    chat_chunk,
    chat_completion,
    chunk,
    completion,
    ok,
    sse,
    tool_call,
)

MODELS = ok({"object": "list", "data": [{"id": "fake", "object": "model", "created": 1, "owned_by": "t"}]})
CHAT = "/v1/chat/completions"
WEATHER_TOOL: flotilla.Tool = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CITY_SCHEMA = {"title": "City report!", "type": "object",
               "properties": {"city": {"type": "string"}, "temp_c": {"type": "number"}},
               "required": ["city", "temp_c"], "additionalProperties": False}


class Weather(BaseModel):
    city: str
    temp_c: float


class CityArgs(BaseModel):
    city: str


@pytest.fixture(scope="module")
def server() -> Iterator[FakeServer]:
    fake = FakeServer().start()
    yield fake
    fake.stop()


@pytest.fixture()
def fake(server: FakeServer) -> FakeServer:
    server.reset()
    server.script("/v1/models", MODELS)
    return server


def test_structured_and_tool_fields_pass_through_on_every_call(fake: FakeServer) -> None:
    fake.script(CHAT, ok(chat_completion("{}")), sse([chat_chunk({"content": "{}"}, "stop")]),
                ok(chat_completion("{}")))
    fake.script("/v1/completions", ok(completion("a")), sse([chunk("b", "stop")]), ok(completion("c")))
    fmt: flotilla.ResponseFormat = {"type": "json_object"}
    choice: flotilla.ToolChoice = {"type": "function", "function": {"name": "get_weather"}}
    regex: flotilla.StructuredOutputs = {"regex": "[ab]+"}
    with Client(fake.url) as client:
        client.chat("hi", response_format=fmt, tools=[WEATHER_TOOL], tool_choice=choice, max_tokens=4)
        with client.stream_chat("hi", tools=[WEATHER_TOOL], tool_choice="required",
                                structured_outputs={"choice": ["x", "y"]}) as stream:
            list(stream)
        client.complete("hi", structured_outputs=regex)
        with client.stream("hi", structured_outputs={"grammar": "root ::= \"a\""}) as stream:
            list(stream)
        results = client.batch([[{"role": "user", "content": "q"}], "p"], progress=False,
                               structured_outputs={"json": {"type": "object"}})
    assert all(r.ok for r in results)
    chat = [seen.body for seen in fake.requests[CHAT]]
    assert chat[0]["response_format"] == fmt and chat[0]["tools"] == [WEATHER_TOOL]
    assert chat[0]["tool_choice"] == choice and chat[0]["max_tokens"] == 4
    assert "structured_outputs" not in chat[0]  # a field left as None is not sent
    assert chat[1]["tool_choice"] == "required" and chat[1]["structured_outputs"] == {"choice": ["x", "y"]}
    assert chat[1]["stream"] is True and "response_format" not in chat[1]
    assert chat[2]["structured_outputs"] == {"json": {"type": "object"}}
    comp = [seen.body for seen in fake.requests["/v1/completions"]]
    assert [c["structured_outputs"] for c in comp] == [regex, {"grammar": "root ::= \"a\""},
                                                       {"json": {"type": "object"}}]


def test_chat_reply_with_tool_calls(fake: FakeServer) -> None:
    calls = [tool_call("call_1", "get_weather", '{"city": "Oslo"}'), tool_call("call_2", "get_weather", "{bad")]
    fake.script(CHAT, ok(chat_completion(None, tool_calls=calls, finish="tool_calls")))
    with Client(fake.url) as client:
        reply = client.chat("weather?", tools=[WEATHER_TOOL])
    assert (reply.text, reply.finish_reason) == ("", "tool_calls")
    assert reply.tool_calls == [ToolCall("call_1", "get_weather", '{"city": "Oslo"}'),
                                ToolCall("call_2", "get_weather", "{bad")]
    first, second = reply.tool_calls
    assert first.load_arguments() == {"city": "Oslo"} and first.to_json() == calls[0]
    assert first.parse_arguments(CityArgs) == CityArgs(city="Oslo")
    assert first.parse_arguments(WEATHER_TOOL) == {"city": "Oslo"}  # the tool's own parameters schema
    with pytest.raises(StructuredOutputError) as info:
        second.load_arguments()
    assert info.value.text == "{bad" and info.value.finish_reason is None
    with pytest.raises(StructuredOutputError, match="at the top level: 'city' is a required property"):
        ToolCall("call_3", "get_weather", '{"town": "Oslo"}').parse_arguments(WEATHER_TOOL)
    assert flotilla.Completion.from_json(chat_completion("plain")).tool_calls == []


# As OpenAI streams two parallel calls: the first fragment of each has index, id, type, name and
# arguments ""; later ones only index and a piece of arguments; a chunk may carry fragments of both.
TOOL_STREAM = [
    chat_chunk({"role": "assistant", "content": None, "tool_calls": [
        {"index": 0, "id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": ""}}]}),
    chat_chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"ci'}}]}),
    chat_chunk({"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Oslo"}'}},
                               {"index": 1, "id": "call_b", "type": "function",
                                "function": {"name": "get_time", "arguments": ""}}]}),
    chat_chunk({"tool_calls": [{"index": 1, "function": {"arguments": '{"tz": '}}]}),
    chat_chunk({"tool_calls": [{"index": 1, "function": {"arguments": '"CET"}'}}]}),
    chat_chunk({}, "tool_calls"),
    chat_chunk(None, usage={"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14}),
]
JOINED = [ToolCall("call_a", "get_weather", '{"city": "Oslo"}'), ToolCall("call_b", "get_time", '{"tz": "CET"}')]


def test_stream_joins_tool_call_fragments_by_index(fake: FakeServer) -> None:
    fake.script(CHAT, sse(TOOL_STREAM))
    with Client(fake.url) as client, client.stream_chat("weather and time?", tools=[WEATHER_TOOL]) as stream:
        deltas = list(stream)
    assert [len(d.tool_calls) for d in deltas] == [1, 1, 2, 1, 1, 0]
    assert deltas[0].tool_calls[0] == flotilla.ToolCallDelta(0, "call_a", "function", "get_weather", "")
    assert deltas[1].tool_calls[0] == flotilla.ToolCallDelta(0, arguments='{"ci')
    assert stream.tool_calls == JOINED and stream.text == "" and stream.finish_reason == "tool_calls"
    assert stream.ttft_s is not None and len(stream.inter_token_s) == 4  # fragments count as tokens
    assert stream.usage is not None and stream.usage.completion_tokens == 9


def test_stream_tool_call_join_matches_the_openai_client(fake: FakeServer) -> None:
    """The oracle: the official client's own join of the same stream, through its public streaming helper."""
    fake.script(CHAT, sse(TOOL_STREAM))
    client = openai.OpenAI(base_url=f"{fake.url}/v1", api_key="unused", max_retries=0)
    try:
        with client.chat.completions.stream(model="fake", messages=[{"role": "user", "content": "weather?"}],
                                            tools=[WEATHER_TOOL]) as stream:
            final = stream.get_final_completion()
    finally:
        client.close()
    calls = final.choices[0].message.tool_calls or []
    assert [ToolCall(c.id, c.function.name, c.function.arguments) for c in calls] == JOINED


def test_parse_with_a_pydantic_model(fake: FakeServer) -> None:
    fake.script(CHAT, ok(chat_completion('{"city": "Oslo", "temp_c": -3.5}')))
    with Client(fake.url) as client:
        result = client.parse("Weather in Oslo?", response_format=Weather, temperature=0)
    assert result.parsed == Weather(city="Oslo", temp_c=-3.5) and result.parsed_choices == [result.parsed]
    assert result.finish_reason == "stop" and result.text.startswith('{"city"')
    body = fake.requests[CHAT][0].body
    assert body["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "Weather", "schema": Weather.model_json_schema(), "strict": True}}
    assert body["temperature"] == 0 and body["messages"] == [{"role": "user", "content": "Weather in Oslo?"}]


def test_parse_with_a_json_schema_dict_async(fake: FakeServer) -> None:
    fake.script(CHAT, ok(chat_completion('{"city": "Oslo", "temp_c": 4}')))

    async def scenario() -> Any:
        async with AsyncClient(fake.url) as client:
            return await client.parse([{"role": "user", "content": "Oslo?"}], response_format=CITY_SCHEMA)

    assert asyncio.run(scenario()).parsed == {"city": "Oslo", "temp_c": 4}
    spec = fake.requests[CHAT][0].body["response_format"]["json_schema"]
    assert spec == {"name": "City_report_", "schema": CITY_SCHEMA, "strict": True}


def test_parse_failures_carry_the_text_and_finish_reason(fake: FakeServer) -> None:
    cut = '{"city": "Os'
    fake.script(CHAT, ok(chat_completion(cut, finish="length")), ok(chat_completion('{"city": "Oslo"}')),
                ok(chat_completion('{"city": "Oslo", "temp_c": "warm"}')),
                ok(chat_completion(None, tool_calls=[tool_call("c", "get_weather", "{}")], finish="tool_calls")))
    with Client(fake.url) as client:
        with pytest.raises(StructuredOutputError, match="finish_reason 'length'") as info:
            client.parse("Oslo?", response_format=Weather, max_tokens=5)
        err = info.value
        assert (err.text, err.finish_reason) == (cut, "length") and isinstance(err.__cause__, ValidationError)
        assert err.completion is not None and err.completion.usage is not None
        with pytest.raises(StructuredOutputError, match="'temp_c' is a required property") as info:
            client.parse("Oslo?", response_format=CITY_SCHEMA)
        assert info.value.finish_reason == "stop" and info.value.text == '{"city": "Oslo"}'
        with pytest.raises(StructuredOutputError, match="at temp_c: 'warm' is not of type 'number'"):
            client.parse("Oslo?", response_format=CITY_SCHEMA)
        with pytest.raises(StructuredOutputError, match="called tools") as info:
            client.parse("Oslo?", response_format=Weather, tools=[WEATHER_TOOL])
        assert info.value.finish_reason == "tool_calls"
    assert isinstance(info.value, flotilla.FlotillaError) and isinstance(info.value, ValueError)


def test_bad_schemas_and_a_missing_jsonschema_fail_before_any_request(fake: FakeServer,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    fake.script(CHAT, ok(chat_completion('{"city": "Oslo", "temp_c": 1}')))
    with Client(fake.url) as client:
        with pytest.raises(flotilla.ConfigError) as config:
            client.parse("x", response_format={"type": "no-such-type"})
        assert config.value.param == "response_format"
        with pytest.raises(flotilla.ConfigError, match="pydantic model"):
            client.parse("x", response_format=dict)  # type: ignore[type-var]
        monkeypatch.setitem(sys.modules, "jsonschema", None)  # import jsonschema now raises ImportError
        with pytest.raises(flotilla.MissingDependencyError, match="pip install jsonschema") as missing:
            client.parse("x", response_format=CITY_SCHEMA)
        assert missing.value.package == "jsonschema" and isinstance(missing.value, ImportError)
        assert fake.attempts[CHAT] == 0
        assert client.parse("x", response_format=Weather).parsed.city == "Oslo"  # pydantic needs no jsonschema
