"""The pure OpenAI protocol layer: request parsing, error envelope, response builders, SSE."""

from __future__ import annotations

import json
import logging
import pickle
from typing import Any

import httpx2 as httpx  # the HTTP library of this openai release
import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from apps.inputs.kind import RequestKind
from apps.inputs.params import (
    DEFAULT_MAX_BODY_BYTES,
    chat_messages,
    check_model,
    completion_prompts,
    parse_request,
    to_sampling_params,
)
from apps.protocol import models as P
from apps.protocol.errors import APIError, error_response
from kvcache.errors import CacheConfigError
from scheduling.batch import TokenLogprobs
from scheduling.errors import InvalidParameterError
from scheduling.sampling_params import MAX_N, SamplingParams

MAX_LEN = 64


def serve(body: bytes | dict[str, Any], chat: bool = False, n_prompt: int = 4) -> SamplingParams:
    """What the HTTP layer does before the engine: parse, pick the prompt, build params."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    if chat:
        chat_req = parse_request(raw, P.ChatCompletionRequest)
        chat_messages(chat_req)
        return to_sampling_params(chat_req, max_model_len=MAX_LEN, num_prompt_tokens=n_prompt)
    req = parse_request(raw, P.CompletionRequest)
    completion_prompts(req)
    return to_sampling_params(req, max_model_len=MAX_LEN, num_prompt_tokens=n_prompt)


def refused(exc: BaseException, status: int = 400) -> dict[str, Any]:
    """The envelope of ``exc``, checked for shape, status and type."""
    got, body = error_response(exc)
    assert got == status
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    json.dumps(body)
    return body["error"]


def param_of(body: bytes | dict[str, Any], chat: bool = False, n_prompt: int = 4) -> str | None:
    with pytest.raises(Exception) as info:
        serve(body, chat, n_prompt)
    return refused(info.value)["param"]


@pytest.mark.parametrize("body", [b"[1, 2]", b'"hello"', b"5", b"null", b"{not json", b"\xff\xfe{", b"[" * 100_000])
def test_non_object_or_invalid_json_is_400_without_param(body: bytes) -> None:
    assert param_of(body) is None


C = {"model": "tiny", "prompt": "hi"}
BAD_COMPLETION = [
    ({"model": "tiny"}, "prompt"), ({**C, "prompt": ""}, "prompt"), ({**C, "prompt": []}, "prompt"),
    ({**C, "prompt": [[]]}, "prompt"), ({**C, "prompt": [""]}, "prompt"), ({**C, "prompt": ["a", ""]}, "prompt"),
    ({**C, "prompt": [[1], []]}, "prompt"), ({**C, "prompt": ["a", [1]]}, "prompt"),
    ({**C, "prompt": 5}, "prompt"), ({**C, "prompt": [1.5]}, "prompt"), ({**C, "prompt": [True]}, "prompt"),
    ({**C, "max_tokens": "ten"}, "max_tokens"), ({**C, "max_tokens": 0}, "max_tokens"),
    ({**C, "max_tokens": -3}, "max_tokens"), ({**C, "max_tokens": 2.0}, "max_tokens"),
    ({**C, "temperature": "hot"}, "temperature"), ({**C, "temperature": -0.1}, "temperature"),
    ({**C, "temperature": 2.5}, "temperature"), ({**C, "temperature": float("nan")}, "temperature"),
    ({**C, "temperature": True}, "temperature"),
    ({**C, "top_p": 0}, "top_p"), ({**C, "top_p": 1.01}, "top_p"), ({**C, "top_k": -2}, "top_k"),
    ({**C, "min_p": 1.5}, "min_p"), ({**C, "min_p": -0.1}, "min_p"),
    ({**C, "presence_penalty": 2.1}, "presence_penalty"), ({**C, "frequency_penalty": -3}, "frequency_penalty"),
    ({**C, "repetition_penalty": 0}, "repetition_penalty"), ({**C, "repetition_penalty": -1}, "repetition_penalty"),
    ({**C, "n": 0}, "n"), ({**C, "n": 1.5}, "n"), ({**C, "n": MAX_N + 1}, "n"), ({**C, "n": True}, "n"),
    ({**C, "stop": 5}, "stop"), ({**C, "stop": ""}, "stop"), ({**C, "stop": ["\n", ""]}, "stop"),
    ({**C, "stop": [1]}, "stop"), ({**C, "logprobs": 21}, "logprobs"), ({**C, "logprobs": -1}, "logprobs"),
    ({**C, "logprobs": True}, "logprobs"), ({**C, "seed": "x"}, "seed"), ({**C, "stream": "yes"}, "stream"),
    ({**C, "stream_options": {"include_usage": True}}, "stream_options"),
    ({**C, "stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options"),
    ({**C, "stop_token_ids": [-1]}, "stop_token_ids"), ({**C, "ignore_eos": 1}, "ignore_eos"),
    ({**C, "echo": True}, "echo"), ({**C, "suffix": "x"}, "suffix"), ({**C, "best_of": 3}, "best_of"),
    ({**C, "model": 7}, "model"),
    ({**C, "logit_bias": {"x": 1}}, "logit_bias"), ({**C, "logit_bias": {"-1": 1}}, "logit_bias"),
    ({**C, "logit_bias": {"5": 100.5}}, "logit_bias"), ({**C, "logit_bias": {"5": -101}}, "logit_bias"),
    ({**C, "logit_bias": {"5": "a"}}, "logit_bias"),
    ({**C, "logit_bias": [5]}, "logit_bias"),
]


@pytest.mark.parametrize(("body", "param"), BAD_COMPLETION)
def test_completion_errors_name_the_field(body: dict[str, Any], param: str) -> None:
    assert param_of(body) == param


M = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
BAD_CHAT = [
    ({"model": "tiny"}, "messages"), ({**M, "messages": []}, "messages"), ({**M, "messages": "hi"}, "messages"),
    ({**M, "messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ({**M, "messages": [{"content": "x"}]}, "messages"), ({**M, "messages": [{"role": "user"}]}, "messages"),
    ({**M, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ({**M, "max_tokens": 0}, "max_tokens"), ({**M, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({**M, "max_completion_tokens": "ten"}, "max_completion_tokens"),
    ({**M, "logprobs": "yes"}, "logprobs"), ({**M, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({**M, "logprobs": True, "top_logprobs": -1}, "top_logprobs"), ({**M, "top_logprobs": 2}, "top_logprobs"),
    ({**M, "temperature": 3}, "temperature"), ({**M, "n": MAX_N + 1}, "n"), ({**M, "stop": ""}, "stop"),
    ({**M, "tools": [{"type": "function", "function": {}}]}, "tools"),
    ({**M, "tool_choice": "auto"}, "tool_choice"), ({**M, "tool_choice": "required"}, "tool_choice"),
    ({**M, "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ({**M, "logit_bias": {"5": 200}}, "logit_bias"),
    ({**M, "response_format": {"type": "xml"}}, "response_format"),
]  # tools and response_format in depth: tests/apps/inputs/test_structured_request.py, test_tool_calls.py


@pytest.mark.parametrize(("body", "param"), BAD_CHAT)
def test_chat_errors_name_the_field(body: dict[str, Any], param: str) -> None:
    assert param_of(body, chat=True) == param


def test_context_length_errors() -> None:
    assert param_of(C, n_prompt=MAX_LEN) == "prompt"
    assert param_of(C, n_prompt=0) == "prompt"
    with pytest.raises(InvalidParameterError) as info:
        serve({**C, "max_tokens": 10}, n_prompt=60)
    err = refused(info.value)
    assert err["param"] == "max_tokens"
    assert "60" in err["message"] and "10" in err["message"] and "64" in err["message"]
    assert param_of({**M, "max_completion_tokens": 5}, chat=True, n_prompt=60) == "max_completion_tokens"


def test_default_max_tokens() -> None:
    assert serve(C, n_prompt=4).max_tokens == 16
    assert serve(C, n_prompt=60).max_tokens == 4  # capped by the room left
    assert serve(M, chat=True, n_prompt=4).max_tokens == MAX_LEN - 4
    both = {**M, "max_tokens": 50, "max_completion_tokens": 7}
    assert serve(both, chat=True).max_tokens == 7  # max_completion_tokens wins


def test_engine_and_cache_errors_are_400_with_param() -> None:
    err = refused(InvalidParameterError("prompt", "token id 99999 is outside the vocabulary [0, 256)"))
    assert err["param"] == "prompt" and "99999" in err["message"]
    assert refused(CacheConfigError("max_model_len", "too long"))["param"] == "max_model_len"

    class RemoteError(InvalidParameterError):  # how Ray's RayTaskError(cause) behaves
        def __init__(self, cause: InvalidParameterError) -> None:
            Exception.__init__(self, "Traceback ... /secret/path.py")
            self.cause = cause

        def __str__(self) -> str:
            return "Traceback ... /secret/path.py"

    err = refused(RemoteError(InvalidParameterError("prompt", "token id 7 is out")))
    assert err["param"] == "prompt" and "secret" not in err["message"]


def test_model_body_size_and_status_errors() -> None:
    assert check_model(None, "tiny") == "tiny" and check_model("b", ["a", "b"]) == "b"
    with pytest.raises(APIError) as info:
        check_model("gpt-9", "tiny")
    err = refused(info.value, 404)
    assert err["param"] == "model" and err["code"] == "model_not_found"
    with pytest.raises(APIError) as info:
        parse_request(b" " * (DEFAULT_MAX_BODY_BYTES + 1), P.CompletionRequest)
    assert refused(info.value, 413)["code"] == "payload_too_large"
    with pytest.raises(APIError):
        parse_request(b'{"prompt": "x"}', P.CompletionRequest, max_body_bytes=4)
    assert refused(APIError(503, "overloaded", code="overloaded"), 503)["code"] == "overloaded"
    again = pickle.loads(pickle.dumps(APIError(404, "m", param="model", code="c")))
    assert (again.status, again.param, again.code, again.type) == (404, "model", "c", "invalid_request_error")


def test_internal_errors_do_not_leak(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR):
        err = refused(RuntimeError("CUDA OOM at /home/secret/weights.bin"), 500)
    assert "secret" not in json.dumps(err) and err["param"] is None
    assert "secret" in caplog.text  # kept for operators
    event = P.sse_error_event(KeyError("secret"))
    assert event.startswith(b"data: ") and b"secret" not in event
    assert json.loads(event[6:])["error"]["type"] == "server_error"


def test_happy_path_variants() -> None:
    for prompt, want in [("x", ["x"]), ([1, 2], [[1, 2]]), (["x"], ["x"]), ([[3, 4]], [[3, 4]]),
                         (["a", "b", "c"], ["a", "b", "c"]), ([[1], [2, 3]], [[1], [2, 3]])]:
        req = parse_request(json.dumps({**C, "prompt": prompt}).encode(), P.CompletionRequest)
        assert completion_prompts(req) == want
    nulls = {**C, "temperature": None, "n": None, "stop": None, "stream": None, "top_p": None, "unknown": {"x": 1}}
    assert serve(nulls) == SamplingParams(max_tokens=16)
    parts = {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    body = {**M, "messages": [{"role": "system", "content": "s"}, parts, {"role": "assistant", "content": None}]}
    req = parse_request(json.dumps(body).encode(), P.ChatCompletionRequest)
    assert chat_messages(req) == [
        {"role": "system", "content": "s"}, {"role": "user", "content": "a\nb"}, {"role": "assistant", "content": ""}
    ]
    params = serve({**M, "logprobs": True, "top_logprobs": 3, "stop": "\n", "seed": 5, "top_k": 4}, chat=True)
    assert (params.logprobs, params.stop, params.seed, params.top_k) == (3, ("\n",), 5, 4)
    assert serve({**M, "logprobs": True}, chat=True).logprobs == 0
    assert serve({**M, "tool_choice": "none"}, chat=True) == serve(M, chat=True)  # "none" is what we do
    biased = serve({**C, "logit_bias": {"7": 5, "3": -100, "0": 100.0}})
    assert biased.logit_bias == ((0, 100.0), (3, -100.0), (7, 5.0))
    assert biased.sampler_view().logit_bias == biased.logit_bias


def lp(tid: int, logprob: float) -> TokenLogprobs:
    return TokenLogprobs(tid, logprob, [tid, tid + 1], [logprob, float("-inf")])


def decode(tid: int) -> str:
    return chr(ord("a") + tid % 26)


def test_builders_parse_with_openai_types() -> None:
    entries = [lp(0, -0.1), lp(1, -0.2)]
    usage = P.usage(4, 2, num_cached_tokens=3)
    clp = P.completion_logprobs(entries, decode, [5, 6])
    assert clp["text_offset"] == [5, 6] and clp["top_logprobs"][0] == {"a": -0.1, "b": P.MIN_LOGPROB}
    full = P.completion_response("cmpl-1", "tiny", 1, [P.completion_choice(0, "ab", "length", clp)], usage)
    parsed = Completion.model_validate(json.loads(json.dumps(full, allow_nan=False)))
    assert parsed.usage is not None and parsed.usage.prompt_tokens_details.cached_tokens == 3  # type: ignore[union-attr]
    last = P.completion_chunk("cmpl-1", "tiny", 1, [P.completion_choice(0, "b", "stop")])
    Completion.model_validate(last)
    Completion.model_validate(RequestKind.COMPLETION.shape.chunk("cmpl-1", "tiny", 1, [], usage))
    chat_lp = P.chat_logprobs(entries, decode, lambda tid: decode(tid).encode())
    chat = P.chat_completion_response("chat-1", "tiny", 1, [P.chat_choice(0, "ab", "stop", chat_lp)], usage)
    got = ChatCompletion.model_validate(json.loads(json.dumps(chat, allow_nan=False)))
    assert got.choices[0].logprobs.content[1].top_logprobs[1].logprob == P.MIN_LOGPROB  # type: ignore[index,union-attr]
    for choice in [P.chat_delta_choice(0, "", role=True), P.chat_delta_choice(0, "a", None, chat_lp),
                   P.chat_delta_choice(0, None, "length")]:
        ChatCompletionChunk.model_validate(P.chat_completion_chunk("chat-1", "tiny", 1, [choice]))
    tail = ChatCompletionChunk.model_validate(RequestKind.CHAT.shape.chunk("chat-1", "tiny", 1, [], usage))
    assert tail.choices == [] and tail.usage is not None and tail.usage.total_tokens == 6


def test_sse_helpers() -> None:
    assert P.sse_event({"a": "é"}) == 'data: {"a":"é"}\n\n'.encode()
    assert P.SSE_DONE == b"data: [DONE]\n\n"
    assert P.sse_event(P.StreamOptions(include_usage=True)) == b'data: {"include_usage":true}\n\n'
    event = P.sse_error_event(InvalidParameterError("stop", "bad"))
    assert json.loads(event[len(b"data: "):])["error"]["param"] == "stop"


def fake_server(sent: list[dict[str, Any]]) -> openai.OpenAI:
    """An openai client whose HTTP goes to this protocol layer (no network)."""

    def handle(request: httpx.Request) -> httpx.Response:
        body = request.content
        chat = request.url.path.endswith("/chat/completions")
        req = parse_request(body, P.ChatCompletionRequest if chat else P.CompletionRequest)
        sent.append(json.loads(body))
        serve(body, chat=chat)
        u = P.usage(4, 1)
        if not req.stream:
            if chat:
                return httpx.Response(200, json=P.chat_completion_response("c", "tiny", 1, [P.chat_choice(0, "a", "stop")], u))
            return httpx.Response(200, json=P.completion_response("c", "tiny", 1, [P.completion_choice(0, "a", "stop")], u))
        if chat:
            chunks = [P.chat_completion_chunk("c", "tiny", 1, [P.chat_delta_choice(0, "a", "stop", role=True)])]
        else:
            chunks = [P.completion_chunk("c", "tiny", 1, [P.completion_choice(0, t, r)]) for t, r in [("a", None), ("", "stop")]]
        if req.include_usage:
            chunks.append((RequestKind.CHAT if chat else RequestKind.COMPLETION).shape.chunk("c", "tiny", 1, [], u))
        data = b"".join(P.sse_event(c) for c in chunks) + P.SSE_DONE
        return httpx.Response(200, content=data, headers={"content-type": "text/event-stream"})

    return openai.OpenAI(api_key="x", base_url="http://test/v1", http_client=httpx.Client(transport=httpx.MockTransport(handle)))


def test_official_client_round_trip() -> None:
    sent: list[dict[str, Any]] = []
    client = fake_server(sent)
    out = client.completions.create(model="tiny", prompt="Hi", max_tokens=8, temperature=0, logprobs=2,
                                    stop=["\n"], seed=1, extra_body={"top_k": 5})
    assert out.choices[0].text == "a" and sent[-1]["top_k"] == 5
    chunks = list(client.completions.create(model="tiny", prompt=[1, 2], stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[0].choices[0].text == "a" and chunks[0].choices[0].finish_reason is None  # parsed leniently
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 5
    reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                           max_completion_tokens=4, logprobs=True, top_logprobs=2, n=2)
    assert reply.choices[0].message.content == "a" and sent[-1]["max_completion_tokens"] == 4
    stream = client.chat.completions.create(
        model="tiny", stream=True, stream_options={"include_usage": True},
        messages=[{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
    )
    got = list(stream)
    assert got[0].choices[0].delta.content == "a" and got[-1].choices == [] and got[-1].usage is not None


@pytest.mark.parametrize(("body", "param"), [
    (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages.0.content"),
    (b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a\\udfff"}]}]}',
     "messages.0.content.0.text"),
    (b'{"prompt": ["ok", "\\ud83d"]}', "prompt.1"),
    (b'{"prompt": "x", "stop": ["\\udc00"]}', "stop.0"),
])
def test_lone_surrogates_are_refused_with_their_path(body: bytes, param: str) -> None:
    """JSON can escape half a UTF-16 pair; it is not text, so 400 naming where, not a tokenizer crash."""
    model = P.ChatCompletionRequest if b"messages" in body else P.CompletionRequest
    with pytest.raises(APIError) as info:
        parse_request(body, model)
    err = refused(info.value)
    assert err["param"] == param and "surrogate" in err["message"]


def test_paired_surrogates_and_other_unicode_pass() -> None:
    req = parse_request('{"prompt": "\\ud83d\\ude00 é \\u0000 ok"}'.encode(), P.CompletionRequest)
    assert req.prompt == "\U0001F600 é \x00 ok"
