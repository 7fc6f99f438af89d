"""The SDK's pure parts: SSE decoding, result types, error mapping, retry policy, config, progress bar."""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterator

import pytest

import flotilla
from flotilla.config import ClientConfig
from flotilla.errors import from_response, from_stream_event
from flotilla.progress import ProgressBar
from flotilla.retry import RetryPolicy, parse_retry_after
from flotilla.sse import DONE, iter_sse
from flotilla.types import Completion, StreamDelta


def test_sse_joins_data_lines_skips_comments_and_drops_a_cut_event() -> None:
    raw = [b": ping\n", b"data: {\"a\": 1}\n", b"\n", b"event: x\n", b"data:one\n", b"data: two\r\n", b"\r\n",
           b"data: [DONE]\n", b"\n", b"data: cut off"]

    async def lines() -> AsyncIterator[bytes]:
        for line in raw:
            yield line

    async def collect() -> list[str]:
        return [e async for e in iter_sse(lines())]

    assert asyncio.run(collect()) == ['{"a": 1}', "one\ntwo", DONE]


def test_completion_and_chat_results_and_stream_deltas() -> None:
    chat = Completion.from_json({
        "id": "c", "object": "chat.completion", "created": 5, "model": "tiny",
        "choices": [{"index": 1, "message": {"role": "assistant", "content": "B"}, "finish_reason": "stop"},
                    {"index": 0, "message": {"role": "assistant", "content": "A"}, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                  "prompt_tokens_details": {"cached_tokens": 2}},
    })
    assert (chat.text, chat.finish_reason, [c.text for c in chat.choices]) == ("A", "length", ["A", "B"])
    assert chat.usage == flotilla.Usage(3, 2, 5, cached_tokens=2)
    role_only = {"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]}
    assert StreamDelta.from_chunk(role_only) == []
    assert StreamDelta.from_chunk({"choices": [], "usage": {"prompt_tokens": 1}}) == []
    text = {"choices": [{"index": 2, "text": "hi", "finish_reason": None}]}
    assert StreamDelta.from_chunk(text) == [StreamDelta("hi", 2)]
    finish = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    assert StreamDelta.from_chunk(finish) == [StreamDelta("", 0, "stop")]


def test_error_mapping_keeps_message_param_and_code() -> None:
    body = {"error": {"message": "bad t", "type": "invalid_request_error", "param": "temperature", "code": None}}
    err = from_response(400, body)
    assert type(err) is flotilla.BadRequestError and (err.message, err.param, err.code) == ("bad t", "temperature",
                                                                                           None)
    assert "temperature" in str(err)
    assert type(from_response(503, None, fallback="<html>")) is flotilla.ServerError
    assert from_response(503, None, fallback="<html>").message == "<html>"
    assert type(from_response(418, {})) is flotilla.APIStatusError
    event = from_stream_event({"error": {"message": "died", "type": "server_error", "param": None, "code": None}})
    assert type(event) is flotilla.ServerError and event.status == 500


def test_retry_policy_decisions_and_delays() -> None:
    policy = RetryPolicy(max_retries=5, backoff_base_s=1.0, backoff_cap_s=4.0)
    for status, retried in [(408, True), (429, True), (502, True), (503, True), (504, True), (400, False),
                            (404, False), (500, False)]:
        assert policy.should_retry(flotilla.APIStatusError("x", status=status)) is retried
    assert policy.should_retry(flotilla.APIStatusError("Internal Server Error", status=500, enveloped=False))
    assert from_response(500, None, fallback="Internal Server Error").enveloped is False
    assert policy.should_retry(flotilla.APIConnectionError("reset"))
    assert policy.should_retry(flotilla.APITimeoutError("connect", during_connect=True))
    assert not policy.should_retry(flotilla.APITimeoutError("read"))
    for retry, (low, high) in enumerate([(0.5, 1.0), (1.0, 2.0), (2.0, 4.0), (2.0, 4.0)]):
        delays = [policy.delay_s(retry) for _ in range(50)]
        assert all(low <= d <= high for d in delays) and len(set(delays)) > 1  # jittered, capped
    slow = flotilla.RateLimitError("x", status=429, retry_after=30.0)
    assert policy.delay_s(0, slow) == 30.0
    assert RetryPolicy(retry_after_max_s=5.0).delay_s(0, slow) == 5.0
    assert parse_retry_after("2") == 2.0 and parse_retry_after("soon") is None and parse_retry_after(None) is None
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:10 GMT", now=1445412480.0) == 10.0


def test_config_from_arguments_environment_and_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLOTILLA_API_KEY", raising=False)
    monkeypatch.setenv("FLOTILLA_BASE_URL", "http://env-host:9000/")
    config = ClientConfig.resolve()
    assert (config.base_url, config.api_key, config.max_retries) == ("http://env-host:9000", None, 2)
    assert "Authorization" not in config.request_headers()
    given = ClientConfig.resolve("https://h", api_key="k", session_id="s", timeout=5, max_retries=0)
    assert given.request_headers() == {"User-Agent": "flotilla-python", "Authorization": "Bearer k",
                                       "X-Flotilla-Session": "s"}
    assert given.request_headers("t")["X-Flotilla-Session"] == "t" and given.timeout_s == 5
    for kwargs, param in [({"timeout": 0}, "timeout_s"), ({"max_retries": -1}, "max_retries"),
                          ({"backoff_base": 9.0}, "backoff_base_s"), ({"retries": 1}, "retries")]:
        with pytest.raises(flotilla.ConfigError) as info:
            ClientConfig.resolve("http://h", **kwargs)  # type: ignore[arg-type]
        assert info.value.param == param
    with pytest.raises(flotilla.ConfigError) as info:
        ClientConfig.resolve("ftp://h")
    assert info.value.param == "base_url"


def test_progress_bar_on_a_pipe_prints_each_tenth() -> None:
    out = io.StringIO()
    bar = ProgressBar(20, stream=out)
    for i in range(20):
        bar.advance(failed=i == 3)
    bar.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 11 and " 1/20 " in lines[0] and lines[-1].startswith("batch [" + "#" * 30 + "] 20/20 1 failed")
    silent = io.StringIO()
    quiet = ProgressBar(5, enabled=False, stream=silent)
    quiet.advance()
    assert silent.getvalue() == "" and quiet.done == 1
