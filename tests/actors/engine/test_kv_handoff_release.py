"""Prefill/decode disaggregation in process when a hand-over does not complete: nothing is left behind.

A prefill cancelled while its KV is exported keeps no export; an import that
fails in its step puts nothing into the prefix cache; a payload that does not
fit the pool, or that other weights computed (another weight quantization), is
refused by name before any page; a decode replica with a separate draft model
is refused (its draft pool would never see the prompt).
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from dataclasses import replace
from typing import Any

import pytest
import ray
import torch

from actors.api import EngineStats, PrefillResult, SequenceDelta
from actors.config import EngineConfig
from actors.scheduler.actor import SchedulerService
from apps.replica.disaggregation import split_pd
from kvcache.kv_transfer import KVPayload
from scheduling.errors import InvalidParameterError
from scheduling.spec_config import SpeculativeConfig
from tests.actors.checkpoints import write_llama_with_tokenizer
from tests.actors.engine.test_kv_handoff import ENGINE, GREEDY, PROMPTS, assert_all_free
from tests.actors.step_faults import (
    IMPORT_ERROR,
    FailingImportExecutor,
    HeldExportExecutor,
    first_pages,
)

PROMPT = PROMPTS[-1]  # 102 tokens: chunked prefill, six full pages and a part
TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> EngineConfig:
    return EngineConfig(model=str(write_llama_with_tokenizer(tmp_path_factory.mktemp("pd_release"))), **ENGINE)


async def wait_for_steps(service: SchedulerService, num_steps: int) -> None:
    """Poll until ``service`` has run ``num_steps`` steps (short backoff, bounded)."""
    deadline, backoff = time.monotonic() + TIMEOUT_S, 0.005
    while (await service.stats()).num_steps < num_steps:
        assert time.monotonic() < deadline, f"the service did not reach step {num_steps}"
        await asyncio.sleep(backoff)
        backoff = min(2 * backoff, 0.2)


async def finals(service: SchedulerService, consumer: str, request_ids: set[str]) -> dict[str, SequenceDelta]:
    """The final delta of each of ``request_ids`` on ``consumer``."""
    ends: dict[str, SequenceDelta] = {}
    deadline = time.monotonic() + TIMEOUT_S
    while set(ends) != request_ids:
        assert time.monotonic() < deadline, f"{sorted(request_ids - set(ends))} did not finish"
        for message in await service.next_outputs(consumer, timeout_s=1.0):
            ends.update({d.request_id: d for d in message.deltas if d.finish_reason is not None})
    return ends


def test_a_prefill_cancelled_while_its_kv_is_exported_keeps_no_export(config: EngineConfig) -> None:
    entered, release = threading.Event(), threading.Event()

    async def scenario() -> tuple[dict[str, Any], EngineStats, PrefillResult, dict[str, Any], EngineStats, bool]:
        held = functools.partial(HeldExportExecutor, entered=entered, release=release)
        service = SchedulerService(config, executor_factory=held)
        try:
            task = asyncio.ensure_future(service.prefill("cancelled", PROMPT, GREEDY))
            # The step that samples the first token and copies the prompt's pages out is running.
            assert await asyncio.get_running_loop().run_in_executor(None, entered.wait, TIMEOUT_S)
            step = (await service.stats()).num_steps + 1
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            release.set()
            await wait_for_steps(service, step)
            after_cancel = dict(service._engine.exported), await service.stats()
            # The scheduler steps again: the same prompt prefills whole.
            again = await asyncio.wait_for(service.prefill("again", PROMPT, GREEDY), TIMEOUT_S)
            return (*after_cancel, again, dict(service._engine.exported), await service.stats(),
                    (await service.health()).ok)
        finally:
            release.set()
            await service.shutdown()

    exported, stats, again, exported_after, stats_after, healthy = asyncio.run(scenario())
    assert exported == {}, f"the cancelled prefill's KV is kept: {sorted(exported)}"
    assert_all_free(stats)
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert again.kv_bytes > 0 and again.num_prompt_tokens == len(PROMPT)
    assert exported_after == {} and healthy
    assert_all_free(stats_after)


def test_a_failed_import_caches_nothing_and_the_prompt_then_decodes_as_on_a_fresh_engine(
    config: EngineConfig,
) -> None:
    async def scenario() -> tuple[SequenceDelta, int, EngineStats, list[int], list[int], list[EngineStats], bool]:
        prefill, decode = SchedulerService(config), SchedulerService(config, executor_factory=FailingImportExecutor)
        fresh = SchedulerService(config)
        try:
            result = await prefill.prefill("m", PROMPT, GREEDY)
            await decode.submit_prefilled(result, PROMPT, GREEDY, 0.0, consumer_id="pd")
            failed = (await finals(decode, "pd", {"m"}))["m"]  # its step wrote one page of the KV, then failed
            cached, after_failure = await decode.cached_prefix_tokens(PROMPT), await decode.stats()
            later = await asyncio.wait_for(decode.generate("later", PROMPT, GREEDY), TIMEOUT_S)
            expected = await asyncio.wait_for(fresh.generate("fresh", PROMPT, GREEDY), TIMEOUT_S)
            stats = [await s.stats() for s in (prefill, decode, fresh)]
            return (failed, cached, after_failure, later.outputs[0].token_ids, expected.outputs[0].token_ids,
                    stats, (await decode.health()).ok)
        finally:
            for service in (prefill, decode, fresh):
                await service.shutdown()

    failed, cached, after_failure, later, expected, stats, healthy = asyncio.run(scenario())
    assert failed.finish_reason == "error" and IMPORT_ERROR in (failed.error or ""), failed
    assert cached == 0, f"the prefix cache holds {cached} tokens of KV that was never written"
    assert_all_free(after_failure)
    assert after_failure.num_kv_pages_free == after_failure.num_kv_pages_total  # nothing cached at all
    assert later == expected and len(later) == GREEDY.max_tokens
    assert healthy
    for s in stats:
        assert_all_free(s)


def _with_tensors(payload: KVPayload, change: Any) -> KVPayload:
    """``payload`` with ``change`` applied to every k and v tensor."""
    return replace(payload, k=tuple(change(t) for t in payload.k), v=tuple(change(t) for t in payload.v))


# name -> (the payload made from the prefill's, the param the refusal names, words its message holds)
def _mismatches(p: KVPayload) -> dict[str, tuple[tuple[KVPayload, ...], str, tuple[str, ...]]]:
    ps, heads, head_dim = p.page_shape
    return {
        "layers": ((replace(p, k=p.k[:-1], v=p.v[:-1]),), "model",
                   ("num_layers", f"{p.num_layers - 1} layers", f"this pool {p.num_layers}")),
        "kv_heads": ((_with_tensors(p, lambda t: t[:, :, :1]),), "tensor_parallel_size",
                     ("num_kv_heads", "1 kv heads", f"this pool {heads}")),
        "head_dim": ((_with_tensors(p, lambda t: t[..., : head_dim // 2]),), "model",
                     (f"head_dim {head_dim // 2}", f"this pool {head_dim}")),
        "dtype": ((replace(_with_tensors(p, lambda t: t.to(torch.bfloat16)), dtype="bfloat16"),), "dtype",
                  ("bfloat16", "float32")),
        "page_size": ((_with_tensors(p, lambda t: t[:, : ps // 2]),), "page_size",
                      (f"{ps // 2} tokens", f"this pool's {ps}")),
        "tp_ranks": ((p, p), "tensor_parallel_size", ("2 ranks", "has 1")),
        "pages": ((first_pages(p, p.num_pages - 1),), "prompt", (f"{p.num_pages - 1} pages", f"fills {p.num_pages}")),
    }


def test_a_payload_that_does_not_fit_the_pool_is_refused_by_field_before_any_page(config: EngineConfig) -> None:
    async def scenario() -> tuple[dict[str, tuple[str, str] | None], dict[str, tuple[str, tuple[str, ...]]],
                                  EngineStats]:
        prefill, decode = SchedulerService(config), SchedulerService(config)
        try:
            result = await prefill.prefill("m", PROMPT, GREEDY)
            # With Ray up in this process (another module's cluster) the payloads come as an object-store ref.
            payloads = ray.get(result.kv) if isinstance(result.kv, ray.ObjectRef) else result.kv
            cases = _mismatches(payloads[0])
            refused: dict[str, tuple[str, str] | None] = {}
            for name, (kv, _, _) in cases.items():
                try:
                    await decode.submit_prefilled(replace(result, request_id=name, kv=kv), PROMPT, GREEDY, 0.0,
                                                  consumer_id="pd")
                    refused[name] = None
                except InvalidParameterError as err:
                    refused[name] = (err.param, err.message)
            return refused, {n: (c[1], c[2]) for n, c in cases.items()}, await decode.stats()
        finally:
            await prefill.shutdown()
            await decode.shutdown()

    refused, expected, stats = asyncio.run(scenario())
    accepted = [name for name, err in refused.items() if err is None]
    assert not accepted, f"accepted, to fail in a step: {accepted}"
    for name, (param, words) in expected.items():
        got = refused[name]
        assert got is not None and got[0] == param and all(w in got[1] for w in words), (name, got)
    assert stats.num_steps == 0  # nothing was admitted
    assert_all_free(stats)


def _refused_handoff(prefill_config: EngineConfig, decode_config: EngineConfig) -> tuple[InvalidParameterError,
                                                                                          EngineStats]:
    """A prompt prefilled by one engine and handed to another that must refuse it: the refusal, the decoder's stats."""
    async def scenario() -> tuple[InvalidParameterError, EngineStats]:
        prefill, decode = SchedulerService(prefill_config), SchedulerService(decode_config)
        try:
            result = await prefill.prefill("q", PROMPT, GREEDY)
            with pytest.raises(InvalidParameterError) as info:
                await decode.submit_prefilled(result, PROMPT, GREEDY, 0.0, consumer_id="pd")
            return info.value, await decode.stats()
        finally:
            await prefill.shutdown()
            await decode.shutdown()

    return asyncio.run(scenario())


def test_kv_from_a_pool_with_other_weight_quantization_is_refused_by_name_before_any_page(
        config: EngineConfig) -> None:
    """Its pages have the decode pool's layout, but other weights computed them: caching them would be wrong."""
    err, stats = _refused_handoff(replace(config, quantization="int8"), config)
    assert err.param == "quantization" and "'int8'" in err.message and "None" in err.message, err
    assert stats.num_steps == 0  # nothing was admitted
    assert_all_free(stats)


DRAFT_MODEL = {"method": "draft", "num_speculative_tokens": 2}


def test_a_separate_draft_model_is_refused_where_requests_arrive_prefilled(config: EngineConfig) -> None:
    draft = SpeculativeConfig(model=config.model, **DRAFT_MODEL)  # type: ignore[arg-type]
    err, stats = _refused_handoff(config, replace(config, speculative_config=draft))
    assert err.param == "speculative_config.model" and repr(config.model) in err.message
    assert stats.num_steps == 0
    assert_all_free(stats)


def test_the_decode_pool_of_an_app_refuses_a_separate_draft_model_at_build_time() -> None:
    spec = {**DRAFT_MODEL, "model": "tiny"}
    with pytest.raises(InvalidParameterError) as info:  # the app's, which the decode pool inherits
        split_pd({"model": "tiny", "speculative_config": spec, "pd": {"prefill": {}, "decode": {}}})
    assert info.value.param == "speculative_config.model" and "'tiny'" in info.value.message
    with pytest.raises(InvalidParameterError) as info:  # the decode pool's own
        split_pd({"model": "tiny", "pd": {"decode": {"speculative_config": spec}}})
    assert info.value.param == "speculative_config.model"
    # The prefill pool may have one; a self-draft or n-gram drafting on the decode pool reads the imported KV.
    split_pd({"model": "tiny", "pd": {"prefill": {"speculative_config": spec}}})
    split_pd({"model": "tiny", "speculative_config": spec,
              "pd": {"decode": {"speculative_config": {**DRAFT_MODEL, "layers": 1}}}})
    split_pd({"model": "tiny", "pd": {"decode": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}}})
