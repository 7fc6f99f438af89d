"""OpenAI compatibility over live HTTP: prompt batches, one choice per chunk, logprob values,
bytes and offsets, logit_bias, bad tool fields, oversized bodies. Compared with the
offline engine (``LLM``) on the same model, same prompts, greedy."""

from __future__ import annotations

import json
from typing import Any

import httpx2
import openai
import pytest

from apps.inputs.prompt_encoder import PromptEncoder
from apps.llm import LLM
from flotilla.sse import DONE, SSEDecoder
from scheduling.sampling_params import SamplingParams
from tests.serve_harness import TIMEOUT, LiveServer, http

pytestmark = pytest.mark.ray  # on the session's shared cluster: run with the other Ray modules, last (tests/conftest.py)

GREEDY: dict[str, Any] = {"temperature": 0, "extra_body": {"ignore_eos": True}}
TOL = 1e-3  # same weights and kernels; only batch composition may differ


def _offline(llm: LLM, prompts: list[Any], max_tokens: int, n: int = 1, logprobs: int | None = None) -> list[Any]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, n=n, logprobs=logprobs)
    return [o for out in llm.generate(prompts, params, use_tqdm=False) for o in out.outputs]


def _special_texts(llm: LLM) -> set[str]:
    return {t.content for t in llm.tokenizer.added_tokens_decoder.values()}


def _sse(server: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """Every data event of a streaming request, parsed (without [DONE])."""
    events = []
    with httpx2.Client(timeout=TIMEOUT) as web, web.stream("POST", f"{server}{path}", json=body) as resp:
        assert resp.status_code == 200
        decoder = SSEDecoder()  # the SDK's parser: one SSE parser in the repo
        for line in resp.iter_lines():
            data = decoder.feed(line)
            if data is not None and data != DONE:
                events.append(json.loads(data))
    return events


@pytest.mark.parametrize("prompt", [["Once upon a time", "The sea"], [[72, 105], [65, 66, 67], [120]]])
def test_completion_batches_answer_every_prompt_in_order(
    live: LiveServer, client: openai.OpenAI, tiny_llm: LLM, prompt: list[Any]
) -> None:
    offline = _offline(tiny_llm, prompt, 6, n=2)  # prompt k, sequence j -> offline[k * 2 + j]
    resp = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, n=2, **GREEDY)
    assert [c.index for c in resp.choices] == list(range(2 * len(prompt)))
    assert [c.text for c in resp.choices] == [o.text for o in offline]
    prompt_tokens = sum(len(tiny_llm.engine.tokenize(p)) for p in prompt)
    assert resp.usage is not None
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (prompt_tokens, 6 * 2 * len(prompt))
    events = _sse(live.url, "/v1/completions", {"prompt": prompt, "max_tokens": 6, "n": 2, "temperature": 0,
                                                "ignore_eos": True, "stream": True,
                                                "stream_options": {"include_usage": True}})
    texts = [""] * len(offline)
    for event in events[:-1]:
        assert len(event["choices"]) == 1
        texts[event["choices"][0]["index"]] += event["choices"][0]["text"]
    assert texts == [o.text for o in offline]
    assert events[-1]["usage"]["completion_tokens"] == 6 * 2 * len(prompt)
    live.assert_pages_free()


def test_a_batch_with_a_bad_prompt_is_refused_and_leaves_nothing_running(live: LiveServer) -> None:
    status, err = http(f"{live.url}/v1/completions", {"prompt": [[1, 2], [10**7]], "max_tokens": 2})
    assert status == 400 and err["error"]["param"] == "prompt", err
    live.assert_pages_free()


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {"prompt": "abc"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "abc"}]}),
])
def test_streams_with_n_send_one_choice_per_chunk(server: str, path: str, body: dict[str, Any]) -> None:
    events = _sse(server, path, {**body, "n": 3, "max_tokens": 5, "temperature": 1.0, "seed": 2, "stream": True})
    assert events and all(len(e["choices"]) == 1 for e in events)
    assert {e["choices"][0]["index"] for e in events} == {0, 1, 2}


def test_completion_logprobs_match_offline_and_offsets_index_the_text(client: openai.OpenAI, tiny_llm: LLM) -> None:
    prompts = [f"prompt {i}: \u00e9t\u00e9" for i in range(8)]
    # The first prompt whose greedy text holds a character of several bytes (split over tokens).
    prompt, want = next((p, o) for p in prompts if not (o := _offline(tiny_llm, [p], 24, logprobs=3)[0]).text.isascii())
    choice = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, logprobs=3, **GREEDY).choices[0]
    lp = choice.logprobs
    assert choice.text == want.text and lp is not None and want.logprobs is not None
    assert lp.token_logprobs == pytest.approx([e.logprob for e in want.logprobs], abs=TOL)
    for got, entry in zip(lp.top_logprobs or [], want.logprobs, strict=True):
        expected: dict[str, float] = {}  # alternatives that decode alike keep the likeliest (a dict key each)
        for tid, value in zip(entry.top_token_ids, entry.top_logprobs, strict=True):
            expected.setdefault(tiny_llm.tokenizer.decode([tid]), value)
        assert got == pytest.approx(expected, abs=TOL)
    offsets, tokens = lp.text_offset or [], lp.tokens or []
    assert offsets == sorted(offsets) and all(0 <= o <= len(choice.text) for o in offsets)
    special = _special_texts(tiny_llm)  # skipped in the text: no place of their own
    for offset, token in zip(offsets, tokens, strict=True):
        if "\ufffd" not in token and token not in special:
            assert choice.text[offset:].startswith(token), (offset, token, choice.text)


def test_chat_logprobs_match_offline_with_the_tokens_own_bytes(client: openai.OpenAI, tiny_llm: LLM) -> None:
    messages: list[Any] = [{"role": "user", "content": "hi there"}]
    [want] = [o for out in tiny_llm.chat(messages, SamplingParams(max_tokens=16, temperature=0.0, logprobs=20),
                                         use_tqdm=False) for o in out.outputs]
    resp = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=16,
                                          temperature=0, logprobs=True, top_logprobs=20)
    content = resp.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and want.logprobs is not None
    assert [c.logprob for c in content] == pytest.approx([e.logprob for e in want.logprobs], abs=TOL)
    assert [[t.logprob for t in c.top_logprobs] for c in content] == [
        pytest.approx(e.top_logprobs, abs=TOL) for e in want.logprobs]
    assert [c.token for c in content] == [tiny_llm.tokenizer.decode([t]) for t in want.token_ids]
    partial = [t for c in content for t in [c, *c.top_logprobs] if t.token == "\ufffd"]
    assert partial, "20 alternatives at 16 positions include a byte of a multi-byte character"
    for t in partial:  # the tiny model's tokens are single bytes: a lone byte >= 0x80, not U+FFFD's three
        assert t.bytes is not None and len(t.bytes) == 1 and t.bytes[0] >= 0x80, t
    for c, token_id in zip(content, want.token_ids, strict=True):  # a byte token's bytes are its id
        assert c.bytes == ([token_id] if token_id < 256 else list(c.token.encode())), (token_id, c)


def test_logit_bias_steers_generation(server: str, client: openai.OpenAI, tiny_llm: LLM) -> None:
    forced = client.completions.create(model="tiny", prompt="hello", max_tokens=5,
                                       logit_bias={str(ord("Z")): 100}, **GREEDY)
    assert forced.choices[0].text == "ZZZZZ"
    [plain] = _offline(tiny_llm, ["hello"], 4)
    ban = {plain.token_ids[0]: -100}
    [offline] = tiny_llm.generate("hello", SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True,
                                                          logit_bias=tuple(ban.items())), use_tqdm=False)
    assert offline.outputs[0].token_ids[0] != plain.token_ids[0]
    banned = client.completions.create(model="tiny", prompt="hello", max_tokens=4,
                                       logit_bias={str(t): b for t, b in ban.items()}, **GREEDY)
    assert banned.choices[0].text == offline.outputs[0].text
    for bias in ({"100000000": 1}, {"7": 101}, {"x": 1}):
        status, err = http(f"{server}/v1/chat/completions",
                           {"messages": [{"role": "user", "content": "hi"}], "logit_bias": bias})
        assert status == 400 and err["error"]["param"] == "logit_bias", err


@pytest.mark.parametrize("field", [{"tool_choice": "auto"}, {"tool_choice": "required"},
                                   {"tools": [{"type": "function", "function": {"name": "a b"}}]}])
def test_bad_tool_fields_are_refused_naming_them(server: str, field: dict[str, Any]) -> None:
    status, err = http(f"{server}/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], **field})
    assert status == 400 and err["error"]["param"] == next(iter(field)), err


def test_a_64_mib_body_gets_the_413_envelope(server: str) -> None:
    body = b'{"prompt": "' + b"x" * (64 * 1024 * 1024) + b'"}'
    status, err = http(f"{server}/v1/completions", body)
    assert status == 413 and err["error"]["code"] == "payload_too_large", err
    status, resp = http(f"{server}/v1/completions", {"prompt": "hi", "max_tokens": 1})
    assert status == 200 and resp["usage"]["completion_tokens"] == 1


def test_long_prompts_tokenize_like_the_engine(server: str, tiny_llm: LLM) -> None:
    """Past the off-loop threshold (apps.inputs.prompt_encoder) ids are the same as inline."""
    text = "a long prompt, " * 400  # 6,000 characters: encoded in a thread
    status, body = http(f"{server}/tokenize", {"prompt": text})
    assert status == 200 and body["tokens"] == tiny_llm.engine.tokenize(text)
    messages = [{"role": "user", "content": text}]
    status, chat = http(f"{server}/tokenize", {"messages": messages})
    assert status == 200 and chat["tokens"] == PromptEncoder(tiny_llm.tokenizer).chat_ids(messages)  # inline
    status, err = http(f"{server}/v1/completions", {"prompt": text, "max_tokens": 1})  # longer than max_model_len
    assert status == 400 and err["error"]["param"] == "prompt" and str(len(body["tokens"])) in err["error"]["message"]
