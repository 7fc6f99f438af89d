"""Structured output and tool calling over live HTTP with the official ``openai`` client (the tiny model).

The tiny model's weights are random, so whatever it says is noise: that the
replies parse and validate (``jsonschema``) shows the engine's token masks
hold. Schemas are chosen so a valid reply is short; greedy, generous
max_tokens. Streams, rebuilt by openai-python's own accumulator, must give
the tool calls of the non-streaming reply. Bad specs are 400s naming the
field, including those only the engine's compile can judge (regex, grammar).
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion

from tests.serve_harness import LiveServer, http

pytestmark = pytest.mark.ray  # on the session's shared cluster: run with the other Ray modules, last (tests/conftest.py)

ASK: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY: dict[str, Any] = {"model": "tiny", "temperature": 0, "max_tokens": 200}
ANSWER = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "blue"]}},
          "required": ["ok", "color"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}, "rain": {"type": "boolean"}},
           "required": ["unit", "rain"], "additionalProperties": False}
PING = {"type": "object", "properties": {"loud": {"type": "boolean"}}, "required": ["loud"],
        "additionalProperties": False}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Today's weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "ping", "parameters": PING, "strict": True}},
]
SCHEMAS = {"get_weather": WEATHER, "ping": PING}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _chat(client: openai.OpenAI, **kwargs: Any) -> Any:
    """``chat.completions.create`` with plain-dict arguments (the SDK's TypedDicts are not the point here)."""
    return client.chat.completions.create(**kwargs)


def _complete(client: openai.OpenAI, **kwargs: Any) -> Any:
    return client.completions.create(**kwargs)


def _favour(live: LiveServer, char: str) -> dict[str, Any]:
    """GREEDY with the token of ``char`` favoured where the constraint allows it (it ends a short reply)."""
    [token] = http(f"{live.url}/tokenize", {"prompt": char})[1]["tokens"][-1:]
    return {**GREEDY, "logit_bias": {str(token): 100}}


def _calls(message: Any) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def _check_calls(resp: ChatCompletion) -> list[tuple[str, str]]:
    """Each choice's calls, each valid: an id, a known tool, arguments that validate; content null."""
    out = []
    for choice in resp.choices:
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None and choice.message.tool_calls
        for call in choice.message.tool_calls:
            assert call.type == "function" and re.fullmatch(r"call_[0-9a-f]{24}", call.id)
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        out.extend(_calls(choice.message))
    return out


def test_json_schema_replies_validate(live: LiveServer, client: openai.OpenAI) -> None:
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}
    resp = _chat(client, messages=ASK, response_format=fmt, n=2, **GREEDY)
    for choice in resp.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content or ""), ANSWER)
    text = _complete(client, prompt="Answer:", extra_body={"response_format": fmt}, **GREEDY)
    jsonschema.validate(json.loads(text.choices[0].text), ANSWER)
    live.assert_pages_free()


def test_json_object_replies_parse_to_an_object(live: LiveServer, client: openai.OpenAI) -> None:
    """Any object: the random model would ramble inside a string, so '}' is favoured (logit_bias).

    Unconstrained, that bias makes the reply start with '}'; constrained, the
    mask forces '{' first and then lets '}' close the object.
    """
    biased = _favour(live, "}")
    plain = _chat(client, messages=ASK, **{**biased, "max_tokens": 2})
    assert (plain.choices[0].message.content or "").startswith("}")
    resp = _chat(client, messages=ASK, response_format={"type": "json_object"}, **biased)
    assert resp.choices[0].finish_reason == "stop", resp.choices[0]
    assert json.loads(resp.choices[0].message.content or "") == {}
    text = _complete(client, prompt="{", extra_body={"response_format": {"type": "json_object"}}, **biased)
    assert json.loads(text.choices[0].text) == {}


def test_regex_and_choice_on_completions(client: openai.OpenAI) -> None:
    pattern = r"(yes|no)-[0-9]{2}"
    regex = _complete(client, prompt="Code:", extra_body={"structured_outputs": {"regex": pattern}}, **GREEDY)
    assert regex.choices[0].finish_reason == "stop" and re.fullmatch(pattern, regex.choices[0].text)
    words = ["alpha", "beta", "gamma"]
    choice = _complete(client, prompt="Pick:", n=2, extra_body={"structured_outputs": {"choice": words}}, **GREEDY)
    assert all(c.text in words for c in choice.choices)
    chat = _chat(client, messages=ASK, extra_body={"structured_outputs": {"choice": ["up", "down"]}}, **GREEDY)
    assert chat.choices[0].message.content in ("up", "down")


def test_a_named_tool_call_has_valid_arguments(client: openai.OpenAI) -> None:
    resp = _chat(client, messages=ASK, tools=TOOLS, tool_choice=NAMED, **GREEDY)
    [(name, _)] = _check_calls(resp)
    assert name == "get_weather"


def test_required_returns_at_least_one_valid_call(live: LiveServer, client: openai.OpenAI) -> None:
    """The random model adds calls until max_tokens (a valid but truncated array): ']' is favoured."""
    resp = _chat(client, messages=ASK, tools=TOOLS, tool_choice="required", **_favour(live, "]"))
    calls = _check_calls(resp)
    assert calls and all(name in SCHEMAS for name, _ in calls)
    cut = _chat(client, messages=ASK, tools=TOOLS, tool_choice="required", **GREEDY)
    assert cut.choices[0].finish_reason == "length" and len(_calls(cut.choices[0].message)) >= 2


@pytest.mark.parametrize("tool_choice", [NAMED, "required"])
def test_streamed_tool_calls_rebuild_the_whole_reply(live: LiveServer, client: openai.OpenAI, tool_choice: Any) -> None:
    args = {"messages": ASK, "tools": TOOLS, "tool_choice": tool_choice, "n": 2, **_favour(live, "]")}
    whole = _chat(client, **args)
    state = ChatCompletionStreamState(input_tools=TOOLS)
    first_deltas: list[Any] = []
    for chunk in _chat(client, **args, stream=True):
        state.handle_chunk(chunk)
        for choice in chunk.choices:
            first_deltas.extend(d for d in choice.delta.tool_calls or [] if d.id is not None)
    rebuilt = state.get_final_completion()
    assert [_calls(c.message) for c in rebuilt.choices] == [_calls(c.message) for c in whole.choices]
    assert [c.finish_reason for c in rebuilt.choices] == [c.finish_reason for c in whole.choices]
    assert len(first_deltas) == sum(len(_calls(c.message)) for c in whole.choices) >= 2
    assert all(d.function.arguments == "" and d.function.name in SCHEMAS for d in first_deltas)
    live.assert_pages_free()


def test_auto_and_none_answer_in_text_and_tool_history_is_accepted(client: openai.OpenAI) -> None:
    history: list[Any] = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    for tool_choice in ("auto", "none"):
        resp = _chat(client, messages=history, tools=TOOLS, tool_choice=tool_choice,
                                              **{**GREEDY, "max_tokens": 8})
        choice = resp.choices[0]
        assert choice.finish_reason in ("stop", "length") and isinstance(choice.message.content, str)


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "x", "structured_outputs": {"regex": "(("}}, "structured_outputs.regex"),
    ({"prompt": "x", "structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs.grammar"),
    ({"prompt": "x", "structured_outputs": {"json": {"type": "no-such-type"}}}, "structured_outputs.json"),
    ({"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": "x"}}},
     "response_format"),
    ({"prompt": "x", "response_format": {"type": "yaml"}}, "response_format"),
    ({"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"messages": ASK, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"messages": ASK, "tools": [TOOLS[0], TOOLS[0]]}, "tools"),
    ({"messages": ASK, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools"),
    ({"messages": ASK, "tool_choice": "required"}, "tool_choice"),
])
def test_bad_specs_are_400s_naming_the_field(live: LiveServer, body: dict[str, Any], param: str) -> None:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    for stream in (False, True):
        status, err = http(f"{live.url}{path}", {**body, "max_tokens": 5, "stream": stream})
        assert status == 400 and err["error"]["param"] == param, err
    live.assert_pages_free()
