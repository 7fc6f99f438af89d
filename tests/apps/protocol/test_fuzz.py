"""Fuzzing the generation endpoints (completions, chat, Responses) and embeddings with hypothesis-built bodies.

Bodies are junk of every kind: raw bytes, JSON that is not an object, NaN and
infinities, huge and negative numbers, odd unicode (lone surrogates, NUL,
bidi marks, combining runs), deep nesting, long strings, and valid requests
with one to three fields replaced by such junk. The server must answer each
with a 2xx or 4xx (never a 500, never a stream ending in a ``server_error``
event or a Responses stream failing with the internal error), and its replica
must survive: same replica, healthy, every KV page free at the end.

Cheap by construction: a mutated valid body keeps ``max_tokens`` (Responses:
``max_output_tokens``) small unless it is the field being fuzzed, and then the values drawn are junk,
tiny, or larger than ``max_model_len`` (refused); ``n`` is tiny or absurd. A
body that still runs long is cut by the client timeout and reported as a hang.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from apps.inputs.params import DEFAULT_MAX_BODY_BYTES
from apps.protocol.errors import INTERNAL_ERROR_MESSAGE
from tests.actors.fault_injection import replica_actors
from tests.serve_harness import ENGINE, LiveServer, http

pytestmark = pytest.mark.ray  # on the session's shared cluster: run with the other Ray modules, last (tests/conftest.py)

PATHS = {"completion": "/v1/completions", "chat": "/v1/chat/completions", "responses": "/v1/responses",
         "embeddings": "/v1/embeddings"}
BASES: dict[str, dict[str, Any]] = {
    "completion": {"model": "tiny", "prompt": "hi", "max_tokens": 2},
    "chat": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "responses": {"model": "tiny", "input": "hi", "max_output_tokens": 2},
    "embeddings": {"model": "tiny", "input": "hi"},
}
# The field that carries each endpoint's text.
TEXT_FIELD = {"completion": "prompt", "chat": "messages", "responses": "input", "embeddings": "input"}
# What a prompt over max_model_len is refused as (chat reports its rendered prompt).
OVER_LIMIT_PARAMS = {"completion": ("prompt", "max_tokens"), "chat": ("prompt", "messages", "max_tokens"),
                     "responses": ("input", "max_output_tokens"), "embeddings": ("input",)}
FIELDS = {
    "completion": ["model", "prompt", "max_tokens", "n", "stream", "stream_options", "temperature", "top_p",
                   "top_k", "min_p", "stop", "stop_token_ids", "seed", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "ignore_eos", "logprobs", "echo", "suffix", "best_of", "user",
                   "response_format", "structured_outputs"],
    "chat": ["model", "messages", "max_tokens", "max_completion_tokens", "n", "stream", "stream_options",
             "temperature", "top_p", "top_k", "stop", "seed", "logprobs", "top_logprobs", "tools", "tool_choice",
             "response_format", "structured_outputs", "ignore_eos", "stop_token_ids", "user"],
    "responses": ["model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "seed", "text",
                  "tools", "tool_choice", "parallel_tool_calls", "stream", "store", "previous_response_id",
                  "metadata", "user", "background", "conversation", "reasoning", "include", "truncation",
                  "top_logprobs", "max_tool_calls"],
    "embeddings": ["model", "input", "encoding_format", "dimensions", "user"],
}
MAX_MODEL_LEN = int(ENGINE["max_model_len"])
CLIENT_TIMEOUT_S = 20.0  # far above any cheap request; past it the request counts as hung
EXAMPLES = 150

ODD_STRINGS = [
    "", "\x00", "\ud800", "\udfff", "\ufeff", "\u202e\u202d", "\U0001f468\u200d\U0001f469\u200d\U0001f467",
    "e" + "\u0301" * 200, "\uffff\ufffe", "<|endoftext|>", "{{ raise_exception('x') }}", "%s%n%x",
    "a" * 20_000, "🙂" * 3_000, "\r\n" * 500,
]
HUGE_NUMBERS = [0, -1, 1, 2, 3, 2**31, 2**63, -(2**63) - 1, 10**30, -(10**30), 10**400, 1e308, -1e308, 5e-324,
                float("nan"), float("inf"), float("-inf")]

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.sampled_from(HUGE_NUMBERS),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=40), st.sampled_from(ODD_STRINGS),
)
junk = st.recursive(scalars, lambda inner: st.lists(inner, max_size=5)
                    | st.dictionaries(st.text(max_size=10), inner, max_size=5), max_leaves=20)
# Lengths that are refused (< 1, > max_model_len) or tiny: never a long generation.
lengths = st.one_of(st.integers(max_value=4), st.integers(min_value=MAX_MODEL_LEN), st.sampled_from(HUGE_NUMBERS))
deep = st.integers(min_value=50, max_value=5_000).map(lambda d: "[" * d + "]" * d)


def _value(kind: str, field: str) -> st.SearchStrategy[Any]:
    if field in ("max_tokens", "max_completion_tokens", "max_output_tokens", "n", "best_of"):
        return st.one_of(lengths, junk)
    if (kind, field) in SHAPED:
        return st.one_of(SHAPED[kind, field], junk)
    if field == "messages":
        message = st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "system", "tool"]), junk),
                                         "content": st.one_of(st.sampled_from(ODD_STRINGS), junk)})
        return st.one_of(st.lists(message, max_size=4), junk)
    if field == "prompt":
        return st.one_of(st.sampled_from(ODD_STRINGS), st.lists(st.integers(), max_size=20), junk)
    if field in STRUCTURED:
        return st.one_of(STRUCTURED[field], junk)
    return junk


# Specs that reach the engine's grammar compile (some compile, some must be refused there).
SPECS = ["((", "a*", "[", "(a+)+$", "\\", "{", "root ::= x", 'root ::= "a"', "root ::= root", '{"type": 5}']
_schema = st.one_of(st.just({"type": "object"}), st.sampled_from([{"type": "string", "maxLength": 2},
                                                                  {"$ref": "#/nope"}, {"enum": []}]), junk)
_function = st.fixed_dictionaries({"name": st.one_of(st.sampled_from(["f", "g", ""]), junk)},
                                  optional={"parameters": _schema})
STRUCTURED: dict[str, st.SearchStrategy[Any]] = {
    "structured_outputs": st.dictionaries(st.sampled_from(["json", "regex", "choice", "grammar", "json_object"]),
                                          st.one_of(st.sampled_from(SPECS), _schema), min_size=1, max_size=2),
    "response_format": st.one_of(
        st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
        st.fixed_dictionaries({"type": st.just("json_schema"),
                               "json_schema": st.fixed_dictionaries({"name": st.just("x"), "schema": _schema})})),
    "tools": st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": _function}), max_size=3),
    "tool_choice": st.sampled_from(["none", "auto", "required", {"type": "function", "function": {"name": "f"}}]),
}
_text = st.one_of(st.sampled_from(ODD_STRINGS), st.text(max_size=40))
_item = st.one_of(
    st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "system", "developer", "assistant"]), junk),
                           "content": st.one_of(_text, st.lists(st.fixed_dictionaries(
                               {"type": st.sampled_from(["input_text", "output_text", "input_image"]),
                                "text": _text}), max_size=3), junk)}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": _text, "name": _text, "arguments": _text}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": _text, "output": _text}))
# Endpoint-specific shapes: near-valid values that pass parsing and reach the translation or the engine.
SHAPED: dict[tuple[str, str], st.SearchStrategy[Any]] = {
    ("responses", "input"): st.one_of(_text, st.lists(_item, max_size=4)),
    ("responses", "text"): st.one_of(
        st.sampled_from([{"format": {"type": "text"}}, {"format": {"type": "json_object"}}]),
        st.fixed_dictionaries({"format": st.fixed_dictionaries(
            {"type": st.just("json_schema"), "name": st.just("x"), "schema": _schema})})),
    ("responses", "tools"): st.lists(st.fixed_dictionaries(
        {"type": st.just("function"), "name": st.one_of(st.sampled_from(["f", "g", ""]), junk)},
        optional={"parameters": _schema}), max_size=3),
    ("responses", "tool_choice"): st.sampled_from(["none", "auto", "required", {"type": "function", "name": "f"}]),
    ("responses", "metadata"): st.dictionaries(st.text(max_size=70), st.text(max_size=600), max_size=20),
    ("responses", "user"): st.text(max_size=70),
    ("responses", "previous_response_id"): st.sampled_from(["resp_nope", "resp_elsewhere-0123", ""]),
    ("embeddings", "input"): st.one_of(_text, st.lists(_text, max_size=4), st.lists(st.integers(), max_size=8),
                                       st.lists(st.lists(st.integers(min_value=0, max_value=300), max_size=5),
                                                max_size=3)),
    ("embeddings", "encoding_format"): st.sampled_from(["float", "base64", "binary", ""]),
    ("embeddings", "dimensions"): st.one_of(st.integers(min_value=-2, max_value=100), st.sampled_from(HUGE_NUMBERS)),
}


@st.composite
def mutated(draw: st.DrawFn, kind: str) -> bytes:
    """A valid body with one to three fields replaced (or added) by junk."""
    body = dict(BASES[kind])
    for field in draw(st.lists(st.sampled_from(FIELDS[kind]), min_size=1, max_size=3, unique=True)):
        body[field] = draw(_value(kind, field))
    if draw(st.booleans()):
        body[draw(st.text(min_size=1, max_size=10))] = draw(junk)  # an unknown key
    return json.dumps(body, allow_nan=True).encode()


def bodies(kind: str) -> st.SearchStrategy[bytes]:
    return st.one_of(
        mutated(kind),
        junk.map(lambda v: json.dumps(v, allow_nan=True).encode()),  # any JSON, mostly not an object
        st.binary(max_size=300),                                       # not JSON, maybe not UTF-8
        deep.map(str.encode),                                          # nesting past any sane depth
        st.text(max_size=200).map(lambda t: t.encode("utf-8", "surrogatepass")),
        st.just(b'{"model": "tiny", "prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}"),  # past int parsing
        st.just(b'{"model": "tiny", "input": "hi", "max_output_tokens": 1' + b"0" * 5000 + b"}"),
    )


@pytest.fixture(scope="module")
def web(live: LiveServer) -> Iterator[httpx2.Client]:
    [replica] = replica_actors("flotilla")
    with httpx2.Client(timeout=CLIENT_TIMEOUT_S) as client:
        yield client
    # The replica that answered the fuzz is the one still serving, healthy, with every page free.
    assert [r._actor_id for r in replica_actors("flotilla")] == [replica._actor_id], "the replica died"
    assert http(f"{live.url}/health")[0] == 200
    live.assert_pages_free()
    status, body = http(f"{live.url}/v1/completions", {"prompt": "still fine", "max_tokens": 2})
    assert status == 200, body


def _post(web: httpx2.Client, url: str, body: bytes) -> tuple[int, str]:
    try:
        resp = web.post(url, content=body, headers={"Content-Type": "application/json"})
    except httpx2.TimeoutException:
        pytest.fail(f"no answer within {CLIENT_TIMEOUT_S} s (a hang, or an uncapped generation) for {body[:300]!r}")
    return resp.status_code, resp.text


def _with_text(kind: str, text: str) -> dict[str, Any]:
    """The endpoint's base body with ``text`` as its one prompt."""
    field = TEXT_FIELD[kind]
    return {**BASES[kind], field: [{"role": "user", "content": text}] if field == "messages" else text}


def _check(status: int, text: str, body: bytes) -> None:
    assert status < 500, f"{status} for {body[:300]!r}: {text[:300]}"
    if status == 200 and text.startswith(("data:", "event:")):  # SSE (Responses events start with "event:")
        for failed in ('"server_error"' if text.startswith("data:") else None, INTERNAL_ERROR_MESSAGE):
            assert failed is None or failed not in text, \
                f"stream ended in a server error for {body[:300]!r}: {text[-300:]}"
    elif status != 200:
        error = json.loads(text)["error"]  # every error is the OpenAI envelope
        assert error["message"], text


@pytest.mark.parametrize("kind", list(PATHS))
def test_fuzzed_bodies_never_500(live: LiveServer, web: httpx2.Client, kind: str) -> None:
    url = live.url + PATHS[kind]
    seen: Counter[int] = Counter()

    # derandomize: the same examples every run (a failure reproduces; no flaky coverage).
    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(body=bodies(kind))
    def run(body: bytes) -> None:
        status, text = _post(web, url, body)
        seen[status] += 1
        _check(status, text, body)

    run()
    # The fuzz reached both sides of validation: some bodies generated, most were refused.
    assert seen[200] > 0 and seen[400] > 0, dict(seen)


@pytest.mark.parametrize("kind", list(PATHS))
def test_body_over_the_limit_is_413(live: LiveServer, web: httpx2.Client, kind: str) -> None:
    body = _with_text(kind, "a" * (DEFAULT_MAX_BODY_BYTES + 1))
    status, answer = _post(web, live.url + PATHS[kind], json.dumps(body).encode())
    assert status == 413, answer[:300]
    assert json.loads(answer)["error"]["code"] == "payload_too_large"


@pytest.mark.parametrize("kind", list(PATHS))
@settings(max_examples=10, deadline=None, database=None, derandomize=True)
@given(extra=st.integers(min_value=1, max_value=3 * MAX_MODEL_LEN), text=st.sampled_from(["a", "é", "🙂", "ab "]))
def test_prompt_over_the_limit_is_400(live: LiveServer, web: httpx2.Client, kind: str, extra: int,
                                      text: str) -> None:
    """A prompt of more than max_model_len tokens (byte-level tokenizer: >= 1 token per char)."""
    body = _with_text(kind, text * (MAX_MODEL_LEN + extra))
    status, answer = _post(web, live.url + PATHS[kind], json.dumps(body).encode())
    assert status == 400, answer[:300]
    assert json.loads(answer)["error"]["param"] in OVER_LIMIT_PARAMS[kind], answer[:300]
