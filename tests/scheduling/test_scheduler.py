from __future__ import annotations

import pytest

from kvcache.errors import CacheConfigError
from kvcache.page_allocator import PageAllocator
from scheduling.errors import InvalidParameterError
from scheduling.policy import BatchPolicy
from scheduling.request import Request, RequestStatus
from scheduling.sampling_params import SamplingParams
from scheduling.scheduler_config import SchedulerConfig
from tests.scheduling.driver import VOCAB, assert_pool_clean, drain, make, step
from tests.scheduling.fake_runner import reference_generate


def req(rid: str, prompt: list[int], max_tokens: int, **kw: object) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **kw))  # type: ignore[arg-type]


def test_single_request_generates_reference_tokens() -> None:
    run = make(SchedulerConfig(max_model_len=256, max_num_seqs=16, max_num_batched_tokens=256), num_pages=64)
    prompt = list(range(40))
    run.policy.add(req("a", prompt, 20))
    drain(run)
    r = run.finished["a"]
    assert r.finish_reason == "length"
    assert r.output_token_ids == reference_generate(prompt, 20, VOCAB)
    assert_pool_clean(run)


def test_stop_token_and_eos() -> None:
    run = make(SchedulerConfig(max_model_len=256, max_num_seqs=16, max_num_batched_tokens=256), num_pages=64)
    prompt = [1, 2, 3]
    ref = reference_generate(prompt, 30, VOCAB)
    stop = ref[5]
    run.policy.add(req("a", prompt, 30, stop_token_ids=[stop]))
    r_eos = Request("b", prompt, SamplingParams(max_tokens=30), eos_token_id=stop)
    run.policy.add(r_eos)
    run.policy.add(Request("c", prompt, SamplingParams(max_tokens=30, ignore_eos=True), eos_token_id=stop))
    drain(run)
    first = ref.index(stop)
    assert run.finished["a"].output_token_ids == ref[: first + 1]
    assert run.finished["a"].finish_reason == "stop"
    assert run.finished["b"].output_token_ids == ref[: first + 1]
    assert run.finished["c"].output_token_ids == ref
    assert_pool_clean(run)


def test_chunked_prefill_mixes_with_decodes_under_budget() -> None:
    cfg = SchedulerConfig(max_model_len=1024, max_num_batched_tokens=64, max_num_seqs=8)
    run = make(cfg, num_pages=256)
    run.policy.add(req("short", [7] * 10, 30))
    step(run, keep_batches=True)  # short prompt prefilled
    run.policy.add(req("long", list(range(300)), 5))
    while run.policy.has_work:
        step(run, keep_batches=True)
    mixed = [b for b in run.batches if b.num_seqs == 2 and max(b.query_lens) > 1]
    assert mixed, "a prefill chunk should share a step with a decode"
    assert all(b.num_tokens <= 64 for b in run.batches)
    long_chunks = [b.query_lens[-1] for b in run.batches[1:6]]
    assert sum(long_chunks) >= 300 - 63 and max(long_chunks) == 63
    assert run.finished["long"].output_token_ids == reference_generate(list(range(300)), 5, VOCAB)
    assert_pool_clean(run)


def test_without_chunked_prefill_prompt_runs_whole() -> None:
    cfg = SchedulerConfig(
        max_model_len=128, max_num_batched_tokens=128, max_num_seqs=8, enable_chunked_prefill=False
    )
    run = make(cfg, num_pages=64)
    run.policy.add(req("a", list(range(100)), 3))
    b = step(run)
    assert b is not None and b.query_lens == [100]


def test_max_num_seqs_limits_running() -> None:
    cfg = SchedulerConfig(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64)
    run = make(cfg, num_pages=128)
    for i in range(10):
        run.policy.add(req(str(i), [i, i + 1], 8))
    b = step(run)
    assert b is not None and b.num_seqs == 4
    assert len(run.policy.waiting) == 6
    drain(run)
    assert len(run.finished) == 10


def test_invalid_requests_are_refused_with_param() -> None:
    s = BatchPolicy(SchedulerConfig(max_model_len=32, max_num_seqs=8, max_num_batched_tokens=32), PageAllocator(8))
    with pytest.raises(InvalidParameterError) as e:
        s.add(req("a", [], 4))
    assert e.value.param == "prompt"
    with pytest.raises(InvalidParameterError) as e:
        s.add(req("a", [1] * 32, 1))
    assert e.value.param == "prompt"
    with pytest.raises(InvalidParameterError) as e:
        s.add(req("a", [1] * 20, 13))
    assert e.value.param == "max_tokens" and "33" in str(e.value) and "32" in str(e.value)
    s.add(req("a", [1], 4))
    with pytest.raises(InvalidParameterError) as e:
        s.add(req("a", [1], 4))
    assert e.value.param == "request_id"


def test_pool_smaller_than_max_model_len_is_refused() -> None:
    with pytest.raises(CacheConfigError) as e:
        BatchPolicy(SchedulerConfig(max_model_len=1024, page_size=16), PageAllocator(10))
    assert e.value.param == "max_model_len" and "64" in str(e.value) and "10" in str(e.value)


def test_abort_anywhere_frees_pages() -> None:
    run = make(SchedulerConfig(max_model_len=256, max_num_batched_tokens=32, max_num_seqs=32), num_pages=64)
    s = run.policy
    for i in range(6):
        s.add(req(str(i), list(range(i, i + 50)), 10))
    assert s.abort("0") is not None  # waiting
    step(run)
    step(run)
    running = [r.request_id for r in s.running]
    assert running
    aborted = s.abort(running[0])  # mid-prefill or decoding
    assert aborted is not None and aborted.status is RequestStatus.ABORTED
    assert s.abort(running[0]) is None  # second abort is a no-op
    batch = s.schedule()
    assert batch is not None
    victim = s.running[-1].request_id
    s.abort(victim)  # aborted while its step is in flight
    s.update(batch, run.runner.execute(batch))
    assert victim not in run.finished
    drain(run)
    assert len(run.finished) == 3
    assert_pool_clean(run)


def test_preemption_recomputes_to_identical_output() -> None:
    cfg = SchedulerConfig(max_model_len=128, max_num_batched_tokens=256, max_num_seqs=16, page_size=4)
    run = make(cfg, num_pages=40)  # 16 sequences of ~50 tokens need ~200 pages
    prompts = {str(i): [(i * 7 + j) % VOCAB for j in range(10 + i)] for i in range(16)}
    for rid, p in prompts.items():
        run.policy.add(req(rid, p, 40))
    drain(run)
    assert run.policy.stats.num_preemptions > 0
    for rid, p in prompts.items():
        assert run.finished[rid].output_token_ids == reference_generate(p, 40, VOCAB)
    assert_pool_clean(run)


def test_shared_prefix_is_computed_once() -> None:
    cfg = SchedulerConfig(max_model_len=2048, max_num_batched_tokens=2048, max_num_seqs=16)
    run = make(cfg, num_pages=1024)
    prefix = [(j * 31) % VOCAB for j in range(1000)]
    run.policy.add(req("first", prefix + [1, 2, 3], 4))
    drain(run)
    assert run.finished["first"].num_cached_tokens == 0
    before = run.computed_tokens
    suffixes = {f"r{i}": [i, i + 1, i + 2, i + 3, i + 4] for i in range(8)}
    for rid, suf in suffixes.items():
        run.policy.add(req(rid, prefix + suf, 4))
    drain(run)
    recomputed = run.computed_tokens - before
    # 1,000 prefix tokens = 62.5 pages of 16: the first 992 come from the cache.
    assert recomputed == 8 * ((1000 - 992) + 5 + 3)
    for rid, suf in suffixes.items():
        r = run.finished[rid]
        assert r.num_cached_tokens == 992
        assert r.output_token_ids == reference_generate(prefix + suf, 4, VOCAB)
    assert run.policy.stats.prefix_hit_tokens == 8 * 992
    assert_pool_clean(run)


def test_prefix_caching_off_frees_everything() -> None:
    cfg = SchedulerConfig(max_model_len=256, max_num_seqs=16, max_num_batched_tokens=256, enable_prefix_caching=False)
    run = make(cfg, num_pages=64)
    run.policy.add(req("a", list(range(60)), 5))
    drain(run)
    assert run.policy.cache is None
    assert run.policy.allocator.num_free_pages == 64


def test_namespaces_do_not_share_prefixes() -> None:
    run = make(SchedulerConfig(max_model_len=256, max_num_seqs=16, max_num_batched_tokens=256), num_pages=64)
    prompt = list(range(64))
    run.policy.add(Request("a", prompt, SamplingParams(max_tokens=2), namespace="t1"))
    drain(run)
    run.policy.add(Request("b", prompt, SamplingParams(max_tokens=2), namespace="t2"))
    run.policy.add(Request("c", prompt, SamplingParams(max_tokens=2), namespace="t1"))
    drain(run)
    assert run.finished["b"].num_cached_tokens == 0
    assert run.finished["c"].num_cached_tokens == 48


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_siblings_share_the_prompt_computed_once(prefix_caching: bool) -> None:
    cfg = SchedulerConfig(max_model_len=256, max_num_seqs=16, max_num_batched_tokens=256,
                          enable_prefix_caching=prefix_caching)
    run = make(cfg, num_pages=64)
    prompt = [(j * 11) % VOCAB for j in range(100)]
    run.policy.add(req("g#0", prompt, 6))
    for i in range(1, 4):
        run.policy.add(req(f"g#{i}", prompt, 6), share_prompt_with="g#0")
    drain(run)
    # 100 prompt tokens once, then each sibling recomputes only the 4 past the last full page.
    assert run.computed_tokens == 100 + 3 * 4 + 4 * 5
    for i in range(4):
        assert run.finished[f"g#{i}"].output_token_ids == reference_generate(prompt, 6, VOCAB)
    assert [run.finished[f"g#{i}"].num_cached_tokens for i in range(4)] == [0, 96, 96, 96]
    assert_pool_clean(run)


def test_abort_of_prompt_source_releases_its_siblings() -> None:
    run = make(SchedulerConfig(max_model_len=256, max_num_seqs=16, max_num_batched_tokens=256), num_pages=64)
    prompt = list(range(40))
    run.policy.add(req("g#0", prompt, 3))
    run.policy.add(req("g#1", prompt, 3), share_prompt_with="g#0")
    run.policy.add(req("g#2", prompt, 3), share_prompt_with="g#0")
    run.policy.abort("g#2")  # a parked sibling
    run.policy.abort("g#0")  # the source, before its prompt ran
    drain(run)
    assert set(run.finished) == {"g#1"}
    assert run.finished["g#1"].output_token_ids == reference_generate(prompt, 3, VOCAB)
    assert_pool_clean(run)


def test_requests_in_step_names_exactly_the_planned_ones() -> None:
    cfg = SchedulerConfig(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=64)
    run = make(cfg, num_pages=64)
    for i in range(3):
        run.policy.add(req(str(i), [i + 1, i + 2], 4))
    batch = run.policy.schedule()
    assert batch is not None
    assert [r.request_id for r in run.policy.requests_in_step(batch.step)] == ["0", "1"]
    run.policy.update(batch, run.runner.execute(batch))
    assert run.policy.requests_in_step(batch.step) == []
