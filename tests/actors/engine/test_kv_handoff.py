"""Prefill/decode disaggregation in process: a prompt prefilled by one scheduler service decodes on another
exactly as one service would run it, and every page on both sides is free afterwards."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Any

import pytest

from actors.api import EngineStats, SequenceDelta
from actors.config import EngineConfig
from actors.scheduler.actor import SchedulerService
from scheduling.errors import InvalidParameterError
from scheduling.sampling_params import SamplingParams
from tests.actors.checkpoints import write_llama_with_tokenizer

ENGINE: dict[str, Any] = {"max_model_len": 192, "max_num_seqs": 8, "max_num_batched_tokens": 64,
                          "dtype": "float32", "device": "cpu", "num_kv_pages": 96}
PROMPTS = [[5 + (i * 7 + j * 3) % 200 for j in range(10 + 23 * i)] for i in range(5)]  # up to 102 tokens: chunked
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=12, temperature=0.9, seed=7, ignore_eos=True)
TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> EngineConfig:
    return EngineConfig(model=str(write_llama_with_tokenizer(tmp_path_factory.mktemp("pd"))), **ENGINE)


async def disaggregated(prefill: SchedulerService, decode: SchedulerService,
                        prompts: list[list[int]], params: SamplingParams) -> dict[str, list[SequenceDelta]]:
    """Prefill each prompt on one service, decode it on the other; every delta by request id."""
    ids = [f"r{i}" for i in range(len(prompts))]
    results = await asyncio.gather(*(prefill.prefill(rid, p, params) for rid, p in zip(ids, prompts, strict=True)))
    for result, prompt in zip(results, prompts, strict=True):
        assert result.kv_bytes > 0 and result.num_prompt_tokens == len(prompt)
        await decode.submit_prefilled(result, prompt, params, 0.0, consumer_id="pd")
    deltas: dict[str, list[SequenceDelta]] = {rid: [] for rid in ids}
    deadline = time.monotonic() + TIMEOUT_S
    while not all(d and d[-1].finish_reason for d in deltas.values()):
        assert time.monotonic() < deadline, "disaggregated requests did not finish"
        for message in await decode.next_outputs("pd", timeout_s=1.0):
            for delta in message.deltas:
                deltas[delta.request_id].append(delta)
    return deltas


def tokens(deltas: list[SequenceDelta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def assert_all_free(stats: EngineStats) -> None:
    assert stats.num_unfinished_requests == 0 and stats.num_kv_pages_locked == 0
    assert stats.num_kv_pages_free + stats.num_kv_pages_evictable == stats.num_kv_pages_total


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_disaggregated_outputs_equal_colocated(config: EngineConfig, params: SamplingParams) -> None:
    async def scenario() -> tuple[list[list[int]], list[dict[str, list[SequenceDelta]]], list[EngineStats]]:
        colocated, prefill, decode = SchedulerService(config), SchedulerService(config), SchedulerService(config)
        expected = [(await colocated.generate(f"c{i}", p, params)).outputs[0].token_ids for i, p in enumerate(PROMPTS)]
        first = await disaggregated(prefill, decode, PROMPTS, params)
        second = await disaggregated(prefill, decode, PROMPTS, params)  # the prefill side's cache now holds them
        stats = [await s.stats() for s in (colocated, prefill, decode)]
        for s in (colocated, prefill, decode):
            await s.shutdown()
        return expected, [first, second], stats

    expected, runs, stats = asyncio.run(scenario())
    for run in runs:
        assert [tokens(run[f"r{i}"]) for i in range(len(PROMPTS))] == expected
        assert all(d[-1].finish_reason == "length" for d in run.values())
    assert sum(run[f"r{i}"][0].num_cached_tokens for i in range(len(PROMPTS)) for run in runs[1:]) > 0
    for s in stats:
        assert_all_free(s)


def test_a_first_token_that_ends_the_request_takes_no_page(config: EngineConfig) -> None:
    async def scenario() -> tuple[dict[str, list[SequenceDelta]], EngineStats, EngineStats]:
        prefill, decode = SchedulerService(config), SchedulerService(config)
        out = await disaggregated(prefill, decode, PROMPTS[:2], replace(GREEDY, max_tokens=1))
        stats = await prefill.stats(), await decode.stats()
        await prefill.shutdown()
        await decode.shutdown()
        return out, *stats

    out, prefill_stats, decode_stats = asyncio.run(scenario())
    assert all(len(tokens(d)) == 1 and d[-1].finish_reason == "length" for d in out.values())
    assert decode_stats.num_steps == 0  # nothing to decode
    assert_all_free(prefill_stats)
    assert_all_free(decode_stats)


def test_abort_while_decoding_frees_both_sides(config: EngineConfig) -> None:
    async def scenario() -> tuple[EngineStats, EngineStats]:
        prefill, decode = SchedulerService(config), SchedulerService(config)
        long = replace(GREEDY, max_tokens=120)
        for i, prompt in enumerate(PROMPTS[:3]):
            result = await prefill.prefill(f"a{i}", prompt, long)
            await decode.submit_prefilled(result, prompt, long, 0.0, consumer_id="pd")
        await decode.next_outputs("pd", timeout_s=5.0)
        assert (await decode.stats()).num_running > 0
        for i in range(3):
            await decode.abort(f"a{i}")
        stats = await prefill.stats(), await decode.stats()
        await prefill.shutdown()
        await decode.shutdown()
        return stats

    for stats in asyncio.run(scenario()):
        assert_all_free(stats)


def test_kv_stored_differently_is_refused_before_any_page(config: EngineConfig) -> None:
    async def scenario() -> tuple[InvalidParameterError, EngineStats]:
        prefill, decode = SchedulerService(config), SchedulerService(replace(config, kv_cache_dtype="int8"))
        result = await prefill.prefill("m", PROMPTS[1], GREEDY)
        with pytest.raises(InvalidParameterError) as info:
            await decode.submit_prefilled(result, PROMPTS[1], GREEDY, 0.0, consumer_id="pd")
        stats = await decode.stats()
        await prefill.shutdown()
        await decode.shutdown()
        return info.value, stats

    err, stats = asyncio.run(scenario())
    assert err.param == "kv_cache_dtype" and "'auto'" in err.message
    assert_all_free(stats)
