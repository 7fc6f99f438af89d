"""Retries, backoff and error mapping against a scripted aiohttp server on loopback."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp import web

import flotilla
from flotilla import APIConnectionError, APITimeoutError, AsyncClient, Client
from tests.flotilla.fake_server import FakeServer, chunk, completion, error, hang, ok, sse

FAST: dict[str, Any] = {"backoff_base": 0.01, "backoff_cap": 0.05}  # keep waits short; Retry-After still wins
MODELS = ok({"object": "list", "data": [{"id": "fake", "object": "model", "created": 1, "owned_by": "t"}]})


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


def test_503_twice_then_200_succeeds_on_the_third_attempt(fake: FakeServer) -> None:
    fake.script("/v1/completions", error(503, "busy"), error(503, "busy"), ok(completion("yes")))
    with Client(fake.url, **FAST) as client:
        assert client.complete("hi", max_tokens=1).text == "yes"
    assert fake.attempts["/v1/completions"] == 3


def test_retries_run_out_and_raise_the_last_error(fake: FakeServer) -> None:
    fake.script("/v1/completions", error(502, "bad gateway"))
    with Client(fake.url, max_retries=2, **FAST) as client, pytest.raises(flotilla.ServerError) as info:
        client.complete("hi")
    assert info.value.status == 502 and info.value.message == "bad gateway"
    assert fake.attempts["/v1/completions"] == 3


def test_429_waits_at_least_retry_after(fake: FakeServer) -> None:
    fake.script("/v1/completions", error(429, "slow down", headers={"Retry-After": "1"}), ok(completion("ok")))

    async def scenario() -> float:
        async with AsyncClient(fake.url, **FAST) as client:
            await client.default_model()  # not part of the timed call
            start = time.monotonic()
            assert (await client.complete("hi")).text == "ok"
            return time.monotonic() - start

    assert asyncio.run(scenario()) >= 1.0
    assert fake.attempts["/v1/completions"] == 2


@pytest.mark.parametrize(("status", "cls"), [
    (400, flotilla.BadRequestError), (422, flotilla.BadRequestError), (401, flotilla.AuthenticationError),
    (403, flotilla.AuthenticationError), (404, flotilla.NotFoundError), (413, flotilla.PayloadTooLargeError),
    (500, flotilla.ServerError), (409, flotilla.APIStatusError),
])
def test_other_statuses_are_typed_and_never_retried(fake: FakeServer, status: int,
                                                    cls: type[flotilla.APIStatusError]) -> None:
    fake.script("/v1/completions", error(status, "no good", param="temperature"))
    with Client(fake.url, **FAST) as client, pytest.raises(cls) as info:
        client.complete("hi", temperature=3)
    err = info.value
    assert type(err) is cls and err.status == status and err.param == "temperature" and err.message == "no good"
    assert isinstance(err, flotilla.FlotillaError)
    assert fake.attempts["/v1/completions"] == 1


def test_connection_dropped_after_a_token_is_not_retried(fake: FakeServer) -> None:
    fake.script("/v1/completions", sse([chunk("tok")], drop=True), sse([chunk("again", "length")]))
    seen: list[str] = []
    with Client(fake.url, **FAST) as client, pytest.raises(APIConnectionError) as info, \
            client.stream("hi") as stream:
        seen.extend(d.text for d in stream)
    assert type(info.value) is APIConnectionError
    assert seen == ["tok"] and stream.num_attempts == 1 and stream.ttft_s is not None
    assert fake.attempts["/v1/completions"] == 1


def test_stream_failing_before_its_first_token_is_retried(fake: FakeServer) -> None:
    empty = chunk(None)  # a chunk with no choice: not a token
    fake.script("/v1/completions", sse([empty], drop=True), sse([chunk("a"), chunk("b", "length")]))

    async def scenario() -> tuple[list[str], int]:
        async with AsyncClient(fake.url, **FAST) as client, client.stream("hi") as stream:
            texts = [d.text async for d in stream]
            assert stream.finish_reason == "length" and stream.text == "ab"
            assert stream.ttft_s is not None and len(stream.inter_token_s) == 1
            return texts, stream.num_attempts

    assert asyncio.run(scenario()) == (["a", "b"], 2)
    assert fake.attempts["/v1/completions"] == 2


def test_stream_opening_with_503_is_retried(fake: FakeServer) -> None:
    fake.script("/v1/completions", error(503, "busy"), sse([chunk("x", "stop")]))
    with Client(fake.url, **FAST) as client, client.stream("hi") as stream:
        assert [d.text for d in stream] == ["x"]
    assert fake.attempts["/v1/completions"] == 2


def test_bare_500_from_the_proxy_is_retried_but_flotillas_own_500_is_not(fake: FakeServer) -> None:
    """Serve's proxy answers a plain-text 500 when the replica it picked died before answering."""
    async def proxy_500(request: web.Request) -> web.StreamResponse:
        return web.Response(status=500, text="Internal Server Error")

    fake.script("/v1/completions", proxy_500, sse([chunk("x", "stop")]))
    with Client(fake.url, **FAST) as client, client.stream("hi") as stream:
        assert [d.text for d in stream] == ["x"]
    assert fake.attempts["/v1/completions"] == 2
    fake.script("/v1/chat/completions", error(500, "engine failed"), ok(completion("never")))
    with Client(fake.url, **FAST) as client, pytest.raises(flotilla.ServerError) as info:
        client.chat("hi")
    assert info.value.enveloped and fake.attempts["/v1/chat/completions"] == 1


def test_error_event_mid_stream_is_typed_and_not_retried(fake: FakeServer) -> None:
    failure = {"error": {"message": "engine died", "type": "server_error", "param": None, "code": None}}
    fake.script("/v1/completions", sse([chunk("a"), failure]))
    with Client(fake.url, **FAST) as client, pytest.raises(flotilla.ServerError) as info:
        for _ in client.stream("hi"):
            pass
    assert info.value.message == "engine died" and info.value.status == 500
    assert fake.attempts["/v1/completions"] == 1


def test_stream_without_done_is_a_connection_error(fake: FakeServer) -> None:
    fake.script("/v1/completions", sse([chunk("a")], done=False))
    with Client(fake.url, max_retries=0) as client, pytest.raises(APIConnectionError, match=r"\[DONE\]"):
        list(client.stream("hi"))


def test_total_timeout_is_not_retried(fake: FakeServer) -> None:
    fake.script("/v1/completions", hang(fake))
    with Client(fake.url, timeout=0.3, **FAST) as client, pytest.raises(APITimeoutError) as info:
        client.complete("hi")
    assert not info.value.during_connect
    assert fake.attempts["/v1/completions"] == 1


def test_refused_connection_is_a_connection_error() -> None:
    with socket.socket() as s:  # a port nobody listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
        with Client(url, **FAST) as client, pytest.raises(APIConnectionError) as info:
            client.models()
    assert not isinstance(info.value, APITimeoutError)


def test_headers_api_key_session_and_default_model(fake: FakeServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOTILLA_API_KEY", "sk-env")
    fake.script("/v1/completions", ok(completion("x")))
    with Client(fake.url, session_id="s-client") as client:
        client.complete("a")
        client.complete("b", session_id="s-call")
    with Client(fake.url, api_key="sk-arg") as client:
        client.complete("c", model="other")
    seen = fake.requests["/v1/completions"]
    assert [s.headers["Authorization"] for s in seen] == ["Bearer sk-env", "Bearer sk-env", "Bearer sk-arg"]
    assert [s.headers.get("X-Flotilla-Session") for s in seen] == ["s-client", "s-call", None]
    assert [s.body["model"] for s in seen] == ["fake", "fake", "other"]
    assert fake.attempts["/v1/models"] == 1  # fetched once by the first client, never by the second


def test_batch_keeps_order_and_reports_failures_per_item(fake: FakeServer) -> None:
    async def echo(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body["prompt"] == "bad":
            return await error(400, "bad prompt", param="prompt")(request)
        return await ok(completion(body["prompt"].upper()))(request)

    fake.script("/v1/completions", echo)
    prompts = [f"p{i}" for i in range(40)]
    prompts[7] = "bad"
    with Client(fake.url, **FAST) as client:
        results = client.batch(prompts, concurrency=5, progress=False, max_tokens=1)
    assert [r.index for r in results] == list(range(40))
    assert not results[7].ok and isinstance(results[7].error, flotilla.BadRequestError)
    assert results[7].error.param == "prompt"
    assert [r.unwrap().text for i, r in enumerate(results) if i != 7] == [p.upper() for p in prompts if p != "bad"]
    assert fake.max_in_flight <= 5 and fake.attempts["/v1/completions"] == 40


def test_health_503_is_an_answer_and_metrics_parse(fake: FakeServer) -> None:
    fake.script("/health", error(503, "the scheduler actor is unreachable"))
    text = "# TYPE up gauge\nup 1\n"

    async def metrics(request: web.Request) -> web.StreamResponse:
        return web.Response(text=text, content_type="text/plain")

    fake.script("/metrics", metrics)
    with Client(fake.url, **FAST) as client:
        health = client.health()
        assert (health.ok, health.status, health.message) == (False, 503, "the scheduler actor is unreachable")
        assert client.metrics()["up"][0].value == 1.0
    assert fake.attempts["/health"] == 1
