"""From a request body to the output constraint, the tool plan and the prompt, pure (no engine).

response_format and structured_outputs -> StructuredOutput; tools + tool_choice ->
ToolPlan (constraint, prompt); every bad input a 400 naming its field; the chat
template renders tool calls and tool results whether or not it knows tools.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from actors.load.loader import load_tokenizer
from actors.tokenizing import chat_ids, template_supports_tools
from apps.inputs.params import chat_prompt, parse_request, to_sampling_params
from apps.protocol import models as P
from apps.protocol.errors import error_response
from apps.tools.choice import ToolMode, calls_schema, tool_plan
from scheduling.structured_output import StructuredOutput

C = {"prompt": "hi"}
M = {"messages": [{"role": "user", "content": "hi"}]}
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "ping"}}]
T = {**M, "tools": TOOLS}


def chat(body: dict[str, Any]) -> P.ChatCompletionRequest:
    return parse_request(json.dumps(body).encode(), P.ChatCompletionRequest)


def completion(body: dict[str, Any]) -> P.CompletionRequest:
    return parse_request(json.dumps(body).encode(), P.CompletionRequest)


def constraint(body: dict[str, Any]) -> StructuredOutput | None:
    """What ``to_sampling_params`` puts in SamplingParams (chat when the body has messages)."""
    req = chat(body) if "messages" in body else completion(body)
    if isinstance(req, P.ChatCompletionRequest):
        chat_prompt(req)
    return to_sampling_params(req, max_model_len=64, num_prompt_tokens=4).structured_output


def param_of(body: dict[str, Any]) -> str | None:
    with pytest.raises(Exception) as info:
        constraint(body)
    status, envelope = error_response(info.value)
    assert status == 400, envelope
    return envelope["error"]["param"]


@pytest.mark.parametrize("base", [C, M])
def test_response_format_and_structured_outputs_become_one_constraint(base: dict[str, Any]) -> None:
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    assert constraint(base) is None and constraint({**base, "response_format": {"type": "text"}}) is None
    assert constraint({**base, "response_format": {"type": "json_object"}}) == StructuredOutput.json_object()
    got = constraint({**base, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": schema, "strict": True, "description": "d"}}})
    assert got == StructuredOutput.json_schema(schema, param="response_format")
    so = "structured_outputs"
    assert constraint({**base, so: {"json": schema}}) == StructuredOutput.json_schema(schema)
    assert constraint({**base, so: {"json": json.dumps(schema)}}) == StructuredOutput.json_schema(schema)
    assert constraint({**base, so: {"regex": "[a-z]+"}}) == StructuredOutput("regex", "[a-z]+", "structured_outputs.regex")
    assert constraint({**base, so: {"choice": ["yes", "no"]}}).choices == ["yes", "no"]  # type: ignore[union-attr]
    assert constraint({**base, so: {"grammar": 'root ::= "a"'}}).kind == "grammar"  # type: ignore[union-attr]
    assert constraint({**base, so: {"json_object": True}}).param == "structured_outputs.json_object"  # type: ignore[union-attr]
    both = {**base, "response_format": {"type": "text"}, so: {"regex": "a"}}
    assert constraint(both).kind == "regex"  # type: ignore[union-attr]  # text is no constraint


@pytest.mark.parametrize(("body", "param"), [
    ({**C, "response_format": {"type": "xml"}}, "response_format"),
    ({**M, "response_format": {"type": "json_schema"}}, "response_format"),
    ({**M, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({**C, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}}},
     "response_format"),
    ({**C, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
     "response_format"),
    ({**C, "response_format": "json"}, "response_format"),
    ({**C, "structured_outputs": {}}, "structured_outputs"),
    ({**C, "structured_outputs": {"json_object": False}}, "structured_outputs"),
    ({**C, "structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({**C, "structured_outputs": {"structural_tag": "x"}}, "structured_outputs"),
    ({**C, "structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({**C, "structured_outputs": {"choice": ["a", ""]}}, "structured_outputs.choice"),
    ({**C, "structured_outputs": {"regex": ""}}, "structured_outputs.regex"),
    ({**C, "structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({**C, "structured_outputs": {"json": "[1]"}}, "structured_outputs.json"),
    ({**C, "structured_outputs": {"regex": 5}}, "structured_outputs"),
    ({**C, "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ({**C, "response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
    ({**T, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({**T, "tool_choice": {"type": "function", "function": {"name": "ping"}}, "structured_outputs": {"regex": "a"}},
     "structured_outputs"),
    # tools and tool_choice
    ({**M, "tools": [{"type": "function", "function": {"name": ""}}]}, "tools"),
    ({**M, "tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
    ({**M, "tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools"),
    ({**M, "tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
    ({**M, "tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools"),
    ({**M, "tools": [{"function": {"name": "f"}}]}, "tools"),
    ({**M, "tools": {"name": "f"}}, "tools"),
    ({**M, "tools": [TOOLS[1], TOOLS[1]]}, "tools"),
    ({**M, "tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]}, "tools"),
    ({**M, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]}, "tools"),
    ({**M, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"$defs": [1]}}}],
      "tool_choice": "required"}, "tools"),
    ({**M, "tool_choice": "required"}, "tool_choice"), ({**M, "tool_choice": "auto"}, "tool_choice"),
    ({**M, "tools": [], "tool_choice": "required"}, "tool_choice"),
    ({**M, "tool_choice": {"type": "function", "function": {"name": "ping"}}}, "tool_choice"),
    ({**T, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({**T, "tool_choice": {"type": "function"}}, "tool_choice"),
    ({**T, "tool_choice": "sometimes"}, "tool_choice"),
    ({**T, "tool_choice": 1}, "tool_choice"),
    ({**M, "messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function"}]}]},
     "messages"),
    ({**M, "messages": [{"role": "tool", "tool_call_id": "c"}]}, "messages"),
])
def test_bad_input_is_a_400_naming_the_field(body: dict[str, Any], param: str) -> None:
    assert param_of(body) == param


def test_tool_plans_and_their_constraints() -> None:
    assert tool_plan(chat(M)).mode is ToolMode.NONE and constraint({**T, "tool_choice": "none"}) is None
    auto = tool_plan(chat(T))
    assert auto.mode is ToolMode.AUTO and [f.name for f in auto.offered] == ["get_weather", "ping"]
    assert constraint(T) is None  # auto: free text, parsed for <tool_call> blocks
    named = chat({**T, "tool_choice": {"type": "function", "function": {"name": "ping"}}})
    assert tool_plan(named).offered[0].parameters == {"type": "object"}  # no parameters: any object
    assert constraint(named.model_dump(by_alias=True, exclude_none=True)) == StructuredOutput.json_schema(
        {"type": "object"}, param="tools")
    required = constraint({**T, "tool_choice": "required"})
    assert required is not None and required.param == "tools"
    schema = json.loads(required.spec)
    jsonschema.Draft202012Validator.check_schema(schema)
    good = [{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "ping", "arguments": {}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "get_weather", "arguments": {}}], [{"name": "nope", "arguments": {}}],
                [{"name": "ping", "arguments": {}, "extra": 1}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_required_schema_moves_each_tools_defs_to_the_root() -> None:
    point = {"type": "object", "properties": {"x": {"type": "number"}}}
    params = {"type": "object", "properties": {"at": {"$ref": "#/$defs/Point"}}, "$defs": {"Point": point}}
    body = {**M, "tools": [{"type": "function", "function": {"name": "go", "parameters": params}},
                           {"type": "function", "function": {"name": "stay", "parameters": params}}]}
    schema = calls_schema(tool_plan(chat(body)).offered)
    assert schema["$defs"] == {"Point": point}
    jsonschema.validate([{"name": "go", "arguments": {"at": {"x": 1}}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "go", "arguments": {"at": {"x": "far"}}}], schema)
    other = {**params, "$defs": {"Point": {"type": "string"}}}
    body["tools"][1]["function"]["parameters"] = other  # type: ignore[index]
    assert param_of({**body, "tool_choice": "required"}) == "tools"


# ------------------------------------------------------------------ prompts
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "rain"}]},
]


def test_without_template_tools_everything_is_hermes_text() -> None:
    turns, tools = chat_prompt(chat({"messages": HISTORY, "tools": TOOLS}))
    assert tools is None and [t["role"] for t in turns] == ["system", "user", "assistant", "user"]
    assert turns[0]["content"].startswith("Be brief.\n\n# Tools")
    assert json.dumps(TOOLS[0], ensure_ascii=False) in turns[0]["content"] and "<tool_call>" in turns[0]["content"]
    assert turns[2]["content"] == ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                                   '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    assert turns[3]["content"] == "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response>"
    plain, _ = chat_prompt(chat({**T, "tool_choice": "none"}))
    assert plain == [{"role": "user", "content": "hi"}]  # none: no tools in the prompt
    named, _ = chat_prompt(chat({**T, "tool_choice": {"type": "function", "function": {"name": "ping"}}}))
    assert named[0]["role"] == "system" and '"ping"' in named[0]["content"] and "get_weather" not in named[0]["content"]
    required, _ = chat_prompt(chat({**T, "tool_choice": "required"}))
    assert "JSON array" in required[0]["content"]


def test_with_template_tools_turns_keep_their_structure() -> None:
    turns, tools = chat_prompt(chat({"messages": HISTORY, "tools": TOOLS}), template_tools=True)
    assert tools == [TOOLS[0], {"type": "function", "function": {"name": "ping", "parameters": {"type": "object"}}}]
    assert turns[0] == {"role": "system", "content": "Be brief."}
    assert turns[2]["tool_calls"][1] == {"id": "call_2", "type": "function",
                                         "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    assert turns[4] == {"role": "tool", "content": "rain", "tool_call_id": "call_2"}
    assert chat_prompt(chat({**T, "tool_choice": "none"}), template_tools=True)[1] is None


HERMES_TEMPLATE = (
    "{% if tools %}<|system|>\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|end|>\n{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}{% for c in m.tool_calls or [] %}"
    "<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>"
    "{% endfor %}<|end|>\n{% endfor %}<|assistant|>\n"
)


def test_the_tiny_template_renders_both_ways(tiny_model_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    assert not template_supports_tools(tokenizer)  # plain ChatML-like: tools go in a system message
    turns, tools = chat_prompt(chat({"messages": HISTORY, "tools": TOOLS}))
    text = str(tokenizer.decode(chat_ids(tokenizer, turns, tools)))
    assert "# Tools" in text and "<tool_response>\nrain" in text and '"city": "Oslo"' in text
    tokenizer.chat_template = HERMES_TEMPLATE
    assert template_supports_tools(tokenizer)
    turns, tools = chat_prompt(chat({"messages": HISTORY, "tools": TOOLS}), template_tools=True)
    text = str(tokenizer.decode(chat_ids(tokenizer, turns, tools)))
    assert text.startswith("<|system|>\n# Tools\n") and '"name": "get_weather"' in text
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>' in text
