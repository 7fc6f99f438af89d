"""The SDK against a live flotilla server (local Ray + Serve, tiny model): every call, sync and async."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import flotilla
from flotilla import AsyncClient, Client
from tests.serve_harness import LiveServer, http, poll_until, shared_tiny

pytestmark = pytest.mark.ray  # on the session's shared cluster: run with the other Ray modules, last (tests/conftest.py)

GREEDY: dict[str, Any] = {"temperature": 0, "ignore_eos": True}
PROMPT = "Once upon a time"
MESSAGES: list[dict[str, Any]] = [{"role": "user", "content": "hi there"}]


@pytest.fixture(scope="module")
def live(tiny_model_dir: Path) -> Iterator[LiveServer]:
    """The session's tiny app (``shared_tiny``), left with every page free."""
    server = shared_tiny(tiny_model_dir)
    yield server
    server.assert_pages_free()


@pytest.fixture(scope="module")
def client(live: LiveServer) -> Iterator[Client]:
    with Client(live.url, session_id="sdk-tests") as c:
        yield c


def test_sync_information_calls(client: Client) -> None:
    models = client.models()
    assert [m.id for m in models] == ["tiny"] and models[0].max_model_len == 2048
    assert client.default_model() == "tiny"
    health = client.health()
    assert health.ok and health.status == 200
    tokens = client.tokenize("hello")
    assert tokens.count == len(tokens.tokens) > 0 and tokens.max_model_len == 2048
    assert client.detokenize(tokens.tokens) == "hello"
    chat_tokens = client.tokenize(messages=MESSAGES)
    assert chat_tokens.count > tokens.count  # the chat template adds its markers
    metrics = client.metrics()
    assert all(isinstance(s, flotilla.Sample) for samples in metrics.values() for s in samples)
    # The replica's own gauges, parsed with their labels; nothing is in flight between tests.
    for name in ("flotilla:num_requests_running", "flotilla:num_requests_waiting", "flotilla:kv_cache_usage_perc"):
        [sample] = metrics[name]
        assert sample.labels.get("model_name") == "tiny" and sample.value == 0.0, sample


def generated_tokens(client: Client) -> float:
    """``flotilla:generation_tokens_total`` summed over the replica's label sets."""
    return sum(s.value for samples in client.metrics().values() for s in samples
               if s.name == "flotilla:generation_tokens_total")


def test_sync_complete_chat_and_streams_agree(live: LiveServer, client: Client) -> None:
    before = generated_tokens(client)
    whole = client.complete(PROMPT, max_tokens=16, **GREEDY)
    assert whole.model == "tiny" and whole.finish_reason == "length" and whole.text
    assert whole.usage is not None and whole.usage.completion_tokens == 16
    # /metrics through the SDK counts exactly the tokens the completion's usage reports.
    poll_until(lambda: generated_tokens(client) == before + 16, 10.0,
               lambda: f"generation_tokens_total {generated_tokens(client)}, wanted {before + 16}")
    assert whole.usage.prompt_tokens == client.tokenize(PROMPT).count
    with client.stream(PROMPT, max_tokens=16, **GREEDY) as stream:
        deltas = list(stream)
    assert "".join(d.text for d in deltas) == whole.text == stream.text
    assert deltas[-1].finish_reason == "length" and stream.finish_reason == "length"
    assert stream.ttft_s is not None and stream.ttft_s > 0 and len(stream.inter_token_s) >= 1
    assert stream.usage is not None and stream.usage.completion_tokens == 16 and stream.num_attempts == 1

    chat = client.chat(MESSAGES, max_tokens=12, **GREEDY)
    assert chat.object == "chat.completion" and chat.usage is not None and chat.usage.completion_tokens == 12
    with client.stream_chat(MESSAGES, max_tokens=12, **GREEDY) as stream:
        assert "".join(d.text for d in stream) == chat.text
    assert stream.ttft_s is not None
    live.assert_pages_free()


def test_async_client_every_call(live: LiveServer) -> None:
    async def scenario() -> None:
        async with AsyncClient(live.url) as client:
            assert [m.id for m in await client.models()] == ["tiny"]
            assert (await client.health()).ok
            assert isinstance(await client.metrics(), dict)
            tokens = await client.tokenize(PROMPT)
            assert await client.detokenize(tokens.tokens) == PROMPT
            whole = await client.complete(PROMPT, max_tokens=10, **GREEDY)
            async with client.stream(PROMPT, max_tokens=10, **GREEDY) as stream:
                assert "".join([d.text async for d in stream]) == whole.text
            assert stream.ttft_s is not None and stream.usage is not None
            chat = await client.chat("hi there", max_tokens=8, **GREEDY)
            async with client.stream_chat("hi there", max_tokens=8, **GREEDY) as stream:
                assert "".join([d.text async for d in stream]) == chat.text
            results = await client.batch([PROMPT, MESSAGES], max_tokens=10, progress=False, **GREEDY)
            chat10 = await client.chat(MESSAGES, max_tokens=10, **GREEDY)
            assert [r.unwrap().text for r in results] == [whole.text, chat10.text]

    asyncio.run(scenario())
    live.assert_pages_free()


def test_errors_are_typed_with_param(live: LiveServer, client: Client) -> None:
    with pytest.raises(flotilla.BadRequestError) as bad:
        client.complete(PROMPT, temperature=3)
    assert bad.value.status == 400 and bad.value.param == "temperature" and bad.value.message
    with pytest.raises(flotilla.NotFoundError) as missing:
        client.chat(MESSAGES, model="nope")
    assert missing.value.status == 404 and missing.value.param == "model"
    with pytest.raises(flotilla.BadRequestError) as bad_stream, client.stream(PROMPT, top_p=2.0) as stream:
        list(stream)
    assert bad_stream.value.param == "top_p"
    with pytest.raises(flotilla.PayloadTooLargeError) as big:
        client.complete("x" * (5 * 1024 * 1024))
    assert big.value.status == 413
    assert client.complete(PROMPT, max_tokens=2).usage is not None  # the server is fine afterwards
    live.assert_pages_free()


def test_responses_and_embeddings_sync_and_async(live: LiveServer, client: Client) -> None:
    first = client.responses("Hello there", instructions="Be brief.", max_output_tokens=6, temperature=0)
    assert first.id.startswith("resp_") and first.status in ("completed", "incomplete") and first.text
    assert first.usage is not None and 0 < first.usage.completion_tokens <= 6
    second = client.responses("And then?", previous_response_id=first.id, max_output_tokens=6, temperature=0)
    history = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": first.text},
               {"role": "user", "content": "And then?"}]
    assert second.text == client.responses(history, max_output_tokens=6, temperature=0).text
    weather = {"type": "function", "name": "get_weather",
               "parameters": {"type": "object", "properties": {"rain": {"type": "boolean"}}, "required": ["rain"],
                              "additionalProperties": False}}
    called = client.responses("Weather?", tools=[weather], tool_choice={"type": "function", "name": "get_weather"},
                              max_output_tokens=40, temperature=0)
    [call] = called.tool_calls
    assert call.name == "get_weather" and isinstance(call.load_arguments()["rain"], bool)
    vectors = client.embed(["a sea", "the ship"]).vectors
    assert len(vectors) == 2 and len(vectors[0]) == len(vectors[1]) > 0
    assert client.embed("the ship").vectors[0] == pytest.approx(vectors[1], abs=1e-5)

    async def scenario() -> None:
        async with AsyncClient(live.url) as aclient:
            again = await aclient.responses("And then?", previous_response_id=first.id, max_output_tokens=6,
                                            temperature=0)
            assert again.text == second.text
            assert (await aclient.embed([[1, 2, 3]])).vectors[0] == pytest.approx(
                client.embed([1, 2, 3]).vectors[0], abs=1e-5)
            with pytest.raises(flotilla.NotFoundError) as missing:
                await aclient.responses("x", previous_response_id="resp_unknown")
            assert missing.value.param == "previous_response_id" and "resp_unknown" in missing.value.message

    asyncio.run(scenario())
    with pytest.raises(flotilla.BadRequestError) as bad:
        client.embed([])
    assert bad.value.param == "input"
    status, body = http(f"{live.url}/v1/embeddings", {"input": "x", "dimensions": 3})
    assert status == 400 and body["error"]["param"] == "dimensions", body
    live.assert_pages_free()


def test_stream_closed_early_frees_its_pages(live: LiveServer, client: Client) -> None:
    with client.stream(PROMPT, max_tokens=500, **GREEDY) as stream:
        first = next(stream)
    assert first.text and stream.finish_reason is None
    live.assert_pages_free()


def test_batch_of_200_keeps_input_order(live: LiveServer, client: Client) -> None:
    prompts = [f"{i}: " + "x" * i for i in range(200)]  # every prompt a different length

    async def counts() -> list[int]:
        async with AsyncClient(live.url) as ac:
            return [t.count for t in await asyncio.gather(*(ac.tokenize(p) for p in prompts))]

    expected = asyncio.run(counts())
    assert len(set(expected)) >= 190  # distinct enough that a shuffle would show
    results = client.batch(prompts, concurrency=32, progress=True, max_tokens=4, **GREEDY)
    assert [r.index for r in results] == list(range(200)) and all(r.ok for r in results)
    assert [r.unwrap().usage.prompt_tokens for r in results] == expected  # type: ignore[union-attr]
    for i in (0, 57, 123, 199):
        assert results[i].unwrap().text == client.complete(prompts[i], max_tokens=4, **GREEDY).text
    live.assert_pages_free()
