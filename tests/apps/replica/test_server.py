"""The Serve application on a local Ray cluster: the OpenAI API end to end over HTTP."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml
from ray import serve
from ray.exceptions import ActorDiedError

from actors.api import FinishReason, SequenceDelta, StepMessage
from apps.builder import build_app, split_args
from apps.llm import LLM
from apps.outputs.stream_fanout import RequestStream, StreamFanout
from apps.protocol.errors import APIError
from scheduling.errors import InvalidParameterError
from scheduling.sampling_params import SamplingParams
from tests.serve_harness import LiveServer, http

pytestmark = pytest.mark.ray  # on the session's shared cluster: run with the other Ray modules, last (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[3]


class _FakeActor:
    """``next_outputs`` hands out scripted batches, then raises (the actor died)."""

    def __init__(self, batches: list[list[StepMessage]]) -> None:
        self.batches = batches

    async def next_outputs(self, consumer_id: str, timeout_s: float) -> list[StepMessage]:
        if not self.batches:
            raise ActorDiedError()
        return self.batches.pop(0)


def _delta(rid: str, index: int, text: str, finish: str | None = None) -> SequenceDelta:
    return SequenceDelta(request_id=rid, index=index, token_ids=[1], text=text, logprobs=None,
                         finish_reason=None if finish is None else FinishReason(finish), num_prompt_tokens=3)


def test_fanout_routes_per_request_and_fails_open_requests() -> None:
    async def scenario() -> None:
        step = StepMessage(1, 1, [_delta("a", 0, "x"), _delta("gone", 0, "?"), _delta("b", 0, "y", "length")])
        fanout = StreamFanout(_FakeActor([[step]]), "c1")
        a = RequestStream("a", fanout.open("a"), n=1, num_prompt_tokens=3)
        b = RequestStream("b", fanout.open("b"), n=1, num_prompt_tokens=3)
        assert (await a.next()).text == "x"
        assert (await b.next()).finish_reason == "length" and b.done and b.num_completion_tokens == 1
        fanout.close("b")
        with pytest.raises(APIError) as info:  # the poll failed: open requests end with an error
            await asyncio.wait_for(a.next(), 10.0)
        assert info.value.status == 500 and not a.done
        aborted = RequestStream("c", fanout.open("c"), n=2, num_prompt_tokens=3)
        fanout.dispatch([_delta("c", 1, "", "abort")])
        with pytest.raises(APIError) as info:
            await aborted.next()
        assert info.value.status == 503
        await fanout.stop()

    asyncio.run(scenario())


def test_builder_splits_and_refuses_unknown_args() -> None:
    engine, options = split_args({"model": "tiny", "max_num_seqs": 4, "num_replicas": 2})
    assert engine == {"model": "tiny", "max_num_seqs": 4} and options == {"num_replicas": 2}
    with pytest.raises(InvalidParameterError) as info:
        build_app({"model": "tiny", "max_num_seq": 4})
    assert info.value.param == "max_num_seq"


def test_serve_yaml_is_a_valid_deploy_config() -> None:
    from ray.serve.schema import ServeDeploySchema

    config = ServeDeploySchema.model_validate(yaml.safe_load((ROOT / "ray_configs" / "serve.yaml").read_text()))
    (application,) = config.applications
    assert application.import_path == "apps.builder:build_app"
    assert config.http_options.host == "127.0.0.1" and config.http_options.port == 8000
    assert isinstance(build_app(dict(application.args)), serve.Application)


def test_completion_matches_offline_llm(live: LiveServer, client: openai.OpenAI, tiny_llm: LLM) -> None:
    prompt = "Once upon a time"
    offline = tiny_llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
                                use_tqdm=False)[0]
    resp = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert resp.choices[0].text == offline.outputs[0].text
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == len(offline.prompt_token_ids)
    assert resp.usage.completion_tokens == 24
    stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == offline.outputs[0].text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 24
    live.assert_pages_free()


def test_completion_n_logprobs_stop_seed(client: openai.OpenAI) -> None:
    resp = client.completions.create(model="tiny", prompt="abc", max_tokens=8, n=2, logprobs=2,
                                     temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in resp.choices) == [0, 1]
    for choice in resp.choices:
        assert choice.logprobs is not None and len(choice.logprobs.tokens or []) == 8
        assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs or [])
    assert resp.usage is not None and resp.usage.completion_tokens == 16
    again = client.completions.create(model="tiny", prompt="abc", max_tokens=8, n=2, temperature=1.0, seed=7,
                                      extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in resp.choices]
    greedy = client.completions.create(model="tiny", prompt="abc", max_tokens=40, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].text
    stop = next(ch for ch in greedy[1:] if ch.isprintable() and ch != "\ufffd")
    cut = client.completions.create(model="tiny", prompt="abc", max_tokens=40, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop" and cut.text == greedy[: greedy.index(stop)]


def test_chat_matches_offline_llm(live: LiveServer, client: openai.OpenAI, tiny_llm: LLM) -> None:
    messages: list[Any] = [{"role": "user", "content": "hi there"}]
    offline = tiny_llm.chat(messages, SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)[0]
    resp = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=16,
                                          temperature=0, logprobs=True, top_logprobs=3)
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == offline.outputs[0].text
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert len(choice.logprobs.content) == len(offline.outputs[0].token_ids)
    assert resp.usage is not None and resp.usage.prompt_tokens == len(offline.prompt_token_ids)
    stream = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=16,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == offline.outputs[0].text
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == len(offline.prompt_token_ids)
    live.assert_pages_free()


def test_chat_stream_with_n_matches_non_streaming(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"model": "tiny", "messages": [{"role": "user", "content": "two"}], "n": 2,
                              "max_tokens": 8, "temperature": 1.0, "seed": 3}
    whole = client.chat.completions.create(**kwargs)
    texts, finish = ["", ""], [None, None]
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            finish[choice.index] = choice.finish_reason or finish[choice.index]
    assert texts == [c.message.content for c in sorted(whole.choices, key=lambda c: c.index)]
    assert all(f in ("stop", "length") for f in finish)


def test_models_health_tokenize(server: str, tiny_llm: LLM) -> None:
    status, body = http(f"{server}/v1/models")
    assert status == 200 and [m["id"] for m in body["data"]] == ["tiny"]
    assert http(f"{server}/health") == (200, {"status": "ok"})
    status, body = http(f"{server}/tokenize", {"prompt": "hello"})
    assert status == 200 and body["tokens"] == tiny_llm.engine.tokenize("hello")
    status, body = http(f"{server}/detokenize", {"tokens": body["tokens"]})
    assert (status, body["prompt"]) == (200, "hello")
    status, body = http(f"{server}/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    assert body["tokens"] == tiny_llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)[0].prompt_token_ids


@pytest.mark.parametrize(("body", "status", "param"), [
    (b"{not json", 400, None),
    ({"model": "tiny", "prompt": "hi", "temperature": 3}, 400, "temperature"),
    ({"model": "nope", "prompt": "hi"}, 404, "model"),
    (b'{"prompt": "' + b"x" * (5 * 1024 * 1024) + b'"}', 413, None),
])
def test_errors_then_success(server: str, body: bytes | dict[str, Any], status: int, param: str | None) -> None:
    got, err = http(f"{server}/v1/completions", body)
    assert got == status, err
    assert err["error"]["param"] == param and err["error"]["message"]
    assert err["error"]["type"] == "invalid_request_error"
    ok, resp = http(f"{server}/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert ok == 200 and resp["usage"]["completion_tokens"] == 2


def test_openai_client_raises_typed_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], top_p=2.0)
    assert info.value.body is not None and info.value.body["param"] == "top_p"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x")
