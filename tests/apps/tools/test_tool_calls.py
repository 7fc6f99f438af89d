"""Tool-call parsing, pure: the three scanners, any split of the text, streamed chunks vs the whole message.

The stream side is checked with openai-python's own accumulator
(``ChatCompletionStreamState``): what a client rebuilds from our chunks must
be the message the non-streaming response carries.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from actors.api import FinishReason, SequenceDelta
from actors.load.loader import load_tokenizer
from apps.inputs.kind import RequestKind
from apps.outputs.response_builder import ResponseBuilder
from apps.outputs.token_text import TokenText
from apps.tools.array_scanner import ArrayScanner
from apps.tools.deltas import chunk_deltas, finish_reason
from apps.tools.scanners import (
    HermesScanner,
    NamedScanner,
    ToolCallDelta,
    ToolEvent,
    ToolScanner,
    fold_tool_calls,
    new_tool_call_id,
)


def ids() -> Any:
    counter = itertools.count()
    return lambda: f"call_{next(counter):024x}"


def run(scanner: ToolScanner, pieces: list[str]) -> list[ToolEvent]:
    events = [e for piece in pieces for e in scanner.feed(piece)]
    return events + scanner.finish()


def calls_of(events: list[ToolEvent]) -> tuple[str, list[tuple[str, Any]]]:
    """Content and ``(name, parsed arguments)`` per call (ids differ between runs)."""
    content, calls = fold_tool_calls(events)
    return content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def splits(text: str) -> list[list[str]]:
    """The text whole, one character at a time, and cut in two at every position."""
    return [[text], list(text)] + [[text[:k], text[k:]] for k in range(1, len(text))]


ARRAY = ('[ {"name": "get_weather", "arguments": {"city": "Paris, \\"FR\\" }", "days": [1, {"a": "]}"}],'
         ' "ok": true}},\n  {"arguments": {"x": -1.5e3}, "name": "f"} ]')
ARRAY_CALLS = [("get_weather", {"city": 'Paris, "FR" }', "days": [1, {"a": "]}"}], "ok": True}),
               ("f", {"x": -1500.0})]


def test_call_ids_look_like_openai_ids() -> None:
    one, two = new_tool_call_id(), new_tool_call_id()
    assert one != two and one.startswith("call_") and len(one) == 29 and int(one[5:], 16) >= 0


@pytest.mark.parametrize("pieces", splits(ARRAY))
def test_array_scanner_finds_every_call_however_the_text_is_split(pieces: list[str]) -> None:
    events = run(ArrayScanner(ids()), pieces)
    assert calls_of(events) == ("", ARRAY_CALLS)
    _, calls = fold_tool_calls(events)
    assert calls[0]["function"]["arguments"] == json.dumps(ARRAY_CALLS[0][1], separators=(",", ":"))
    assert [c["id"] for c in calls] == [f"call_{k:024x}" for k in range(2)]


def test_array_scanner_opens_a_call_when_its_name_closes_and_streams_its_arguments() -> None:
    scanner = ArrayScanner(ids())
    assert scanner.feed('[{"name": "get_wea') == []
    opened = scanner.feed('ther", "arguments": {"ci')
    assert opened == [ToolCallDelta(0, "", "call_" + "0" * 24, "get_weather"), ToolCallDelta(0, '{"ci')]
    assert scanner.feed('ty": "P') == [ToolCallDelta(0, 'ty":"P')]
    assert scanner.feed('aris"}}, {"arguments": {"x"') == [ToolCallDelta(0, 'aris"}')]  # held: no name yet
    assert scanner.feed(': 1}, "name": "f"}]') == [ToolCallDelta(1, "", "call_" + "0" * 23 + "1", "f"),
                                                   ToolCallDelta(1, '{"x":1}')]
    assert scanner.feed(' trailing') == [] and scanner.finish() == [] and scanner.num_calls == 2


def test_a_truncated_array_keeps_the_calls_begun() -> None:
    content, calls = fold_tool_calls(run(ArrayScanner(), ['[{"name": "f", "arguments": {"a": [1, 2']))
    assert content == "" and [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("f", '{"a":[1,2')]
    assert run(ArrayScanner(), ['[{"arguments": {"a": 1}']) == []  # never named: no call


@pytest.mark.parametrize("pieces", splits(' {"city" : "Lyon\\n", "n": [1, 2]} '))
def test_named_scanner_is_one_call_of_compact_arguments(pieces: list[str]) -> None:
    events = run(NamedScanner("get_weather", ids()), pieces)
    assert events[0] == ToolCallDelta(0, "", "call_" + "0" * 24, "get_weather")
    _, calls = fold_tool_calls(events)
    assert calls == [{"id": "call_" + "0" * 24, "type": "function",
                      "function": {"name": "get_weather", "arguments": '{"city":"Lyon\\n","n":[1,2]}'}}]


def test_named_scanner_opens_its_call_even_without_text() -> None:
    assert fold_tool_calls(run(NamedScanner("f"), []))[1][0]["function"] == {"name": "f", "arguments": ""}


HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>{"name": "f", "arguments": {}}</tool_call>\n')


@pytest.mark.parametrize("pieces", splits(HERMES))
def test_hermes_blocks_become_calls_and_the_rest_stays_content(pieces: list[str]) -> None:
    got = calls_of(run(HermesScanner(frozenset({"get_weather", "f"}), ids()), pieces))
    assert got == ("Let me check.", [("get_weather", {"city": "Paris"}), ("f", {})])


@pytest.mark.parametrize(("text", "content"), [
    ("no tools here, a < b\n", "no tools here, a < b\n"),  # no call: the text is untouched
    ("<tool_call>{\"name\": \"nope\", \"arguments\": {}}</tool_call>",
     "<tool_call>{\"name\": \"nope\", \"arguments\": {}}</tool_call>"),  # not an offered tool
    ("<tool_call>not json</tool_call> ok", "<tool_call>not json</tool_call> ok"),
    ("<tool_call>{\"name\": \"f\", \"arguments\": [1]}</tool_call>",
     "<tool_call>{\"name\": \"f\", \"arguments\": [1]}</tool_call>"),  # arguments must be an object
    ("a <tool_call>{\"name\": \"f\"", "a <tool_call>{\"name\": \"f\""),  # never closed
    ("ends with <tool_c", "ends with <tool_c"),  # a held-back partial tag is content at the end
])
def test_hermes_text_that_is_not_a_call_is_content(text: str, content: str) -> None:
    for pieces in splits(text):
        assert calls_of(run(HermesScanner(frozenset({"f"})), pieces)) == (content, [])


def test_hermes_holds_back_only_what_may_be_a_tag() -> None:
    scanner = HermesScanner(frozenset({"f"}), ids())
    assert scanner.feed("Hi <tool") == ["Hi"]  # the space may precede a call: held too
    assert scanner.feed("box> there") == [" <toolbox> there"]
    assert scanner.feed('<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call> after') == [
        ToolCallDelta(0, "", "call_" + "0" * 24, "f"), ToolCallDelta(0, '{"a":1}'), "after"]


def test_hermes_calls_and_content_fold_in_order() -> None:
    events = run(HermesScanner(frozenset({"f"}), ids()),
                 ['x <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call> y'])
    assert [e if isinstance(e, str) else (e.opens, e.arguments) for e in events] == [
        "x", (True, ""), (False, '{"a":1}'), "y"]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=len(HERMES)), max_size=8))
def test_any_chunking_folds_to_the_same_message(cuts: list[int]) -> None:
    makers: list[tuple[str, Callable[[], ToolScanner]]] = [
        (HERMES, lambda: HermesScanner(frozenset({"get_weather", "f"}))), (ARRAY, ArrayScanner)]
    for text, make in makers:
        bounds = sorted({min(c, len(text)) for c in cuts})
        pieces = [text[a:b] for a, b in zip([0, *bounds], [*bounds, len(text)], strict=True)]
        assert calls_of(run(make(), pieces)) == calls_of(run(make(), [text]))


def test_chunk_deltas_send_each_opening_alone_then_joined_arguments() -> None:
    events: list[ToolEvent] = ["hi", ToolCallDelta(0, "", "call_a", "f"), ToolCallDelta(0, '{"a"'),
                               ToolCallDelta(0, ":1}"), ToolCallDelta(1, "", "call_b", "g")]
    got = chunk_deltas(0, events, "tool_calls", None, has_tokens=True)
    assert [c["delta"] for c in got] == [
        {"content": "hi"},
        {"tool_calls": [{"index": 0, "id": "call_a", "type": "function", "function": {"name": "f", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"a":1}'}}]},
        {"tool_calls": [{"index": 1, "id": "call_b", "type": "function", "function": {"name": "g", "arguments": ""}}]},
    ]
    assert [c["finish_reason"] for c in got] == [None, None, None, "tool_calls"]
    assert chunk_deltas(0, [], None, None, has_tokens=False) == []
    assert chunk_deltas(0, [], "stop", None, has_tokens=False)[0]["finish_reason"] == "stop"
    stop, length = FinishReason.STOP, FinishReason.LENGTH
    assert (finish_reason(stop, True), finish_reason(length, True), finish_reason(stop, False)) == (
        "tool_calls", "length", "stop")


# ------------------------------------------------------- through ResponseBuilder
@pytest.fixture(scope="module")
def tiny_text(tiny_model_dir: Path) -> TokenText:
    return TokenText(load_tokenizer(tiny_model_dir))


def _deltas(index: int, text: str, size: int, finish: str) -> list[SequenceDelta]:
    parts = [text[k:k + size] for k in range(0, len(text), size)]
    return [SequenceDelta(request_id="r", index=index, token_ids=[1], text=part, logprobs=None,
                          finish_reason=FinishReason(finish) if k == len(parts) - 1 else None)
            for k, part in enumerate(parts)]


def _whole_and_streamed(tiny_text: TokenText, make: Any, texts: list[str], finish: str,
                        tools: list[dict[str, Any]]) -> tuple[ChatCompletion, Any]:
    whole = ResponseBuilder(RequestKind.CHAT, "tiny", 1, False, tiny_text.text, tiny_text.bytes_of, len(texts), make)
    for i, text in enumerate(texts):
        for d in _deltas(i, text, 100, finish):
            whole.add(d)
    response = ChatCompletion.model_validate(RequestKind.CHAT.shape.response(
        "r", "tiny", 1, whole.choices([FinishReason(finish)] * len(texts)), {"prompt_tokens": 1, "completion_tokens": 1,
                                                                "total_tokens": 2}))
    stream = ResponseBuilder(RequestKind.CHAT, "tiny", 1, False, tiny_text.text, tiny_text.bytes_of, len(texts), make)
    state = ChatCompletionStreamState(input_tools=tools)  # type: ignore[arg-type]
    chunks = stream.opening_chunks("r")
    steps = itertools.zip_longest(*[_deltas(i, text, 3, finish) for i, text in enumerate(texts)])
    for step in steps:
        chunks += stream.chunks("r", [d for d in step if d is not None])
    for chunk in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    return response, state.current_completion_snapshot  # get_final_completion refuses "length"


def _named_arguments(calls: Any) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in calls or []]


TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in ("get_weather", "f")]


@pytest.mark.parametrize(("make", "texts", "content"), [
    (lambda: NamedScanner("get_weather"), ['{"city": "Paris"}', ' {"city":\n"Oslo"}'], None),
    (ArrayScanner, [ARRAY, '[{"name": "f", "arguments": {}}]'], None),
    (lambda: HermesScanner(frozenset({"get_weather", "f"})), [HERMES, HERMES], "Let me check."),
])
def test_openai_stream_accumulation_rebuilds_the_whole_message(
    tiny_text: TokenText, make: Any, texts: list[str], content: str | None
) -> None:
    whole, rebuilt = _whole_and_streamed(tiny_text, make, texts, "stop", TOOLS)
    assert len(whole.choices) == len(rebuilt.choices) == len(texts)
    for mine, theirs in zip(whole.choices, rebuilt.choices, strict=True):
        assert mine.finish_reason == theirs.finish_reason == "tool_calls"
        assert mine.message.content == content and (theirs.message.content or None) == content
        assert mine.message.tool_calls and theirs.message.tool_calls
        assert _named_arguments(mine.message.tool_calls) == _named_arguments(theirs.message.tool_calls)
        assert all(c.id.startswith("call_") and len(c.id) == 29 for c in theirs.message.tool_calls)


def test_a_choice_without_calls_is_plain_content_that_stops(tiny_text: TokenText) -> None:
    make = lambda: HermesScanner(frozenset({"f"}))  # noqa: E731
    whole, rebuilt = _whole_and_streamed(tiny_text, make, ["just text\n"], "stop", TOOLS)
    assert whole.choices[0].message.content == rebuilt.choices[0].message.content == "just text\n"
    assert whole.choices[0].message.tool_calls is None and whole.choices[0].finish_reason == "stop"
    cut, _ = _whole_and_streamed(tiny_text, lambda: NamedScanner("f"), ['{"a": '], "length", TOOLS)
    assert cut.choices[0].finish_reason == "length" and _named_arguments(cut.choices[0].message.tool_calls) == [
        ("f", '{"a":')]
