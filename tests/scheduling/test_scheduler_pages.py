"""BatchPolicy page pressure: who is preempted, a blocked head of line, eviction of shared pages."""

from __future__ import annotations

from typing import Any

import pytest

from scheduling.request import Request, RequestStatus
from scheduling.sampling_params import SamplingParams
from scheduling.scheduler_config import SchedulerConfig
from tests.scheduling.driver import VOCAB, assert_pool_clean, drain, make, step
from tests.scheduling.fake_runner import reference_generate


def req(rid: str, prompt: list[int], max_tokens: int) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens))


def test_preemption_takes_the_newest_running_request() -> None:
    cfg = SchedulerConfig(max_model_len=16, max_num_seqs=4, max_num_batched_tokens=64, page_size=4,
                          enable_prefix_caching=False)
    run = make(cfg, num_pages=6)
    s = run.policy
    prompts = {rid: [(i * 13 + j) % VOCAB for j in range(8)] for i, rid in enumerate("abc")}
    for rid, prompt in prompts.items():
        s.add(req(rid, prompt, 8))
    step(run)  # three 8-token prompts fill all 6 pages
    assert s.allocator.num_free_pages == 0
    a, b, c = (s.requests[rid] for rid in "abc")
    step(run)  # every decode needs a third page: the newest, c, makes room
    assert (a.status, b.status, c.status) == (RequestStatus.RUNNING, RequestStatus.RUNNING,
                                              RequestStatus.WAITING)
    assert (a.num_preemptions, b.num_preemptions, c.num_preemptions) == (0, 0, 1)
    assert s.waiting[0] is c  # back at the head of the queue
    drain(run)
    for rid, prompt in prompts.items():
        assert run.finished[rid].output_token_ids == reference_generate(prompt, 8, VOCAB)
    assert_pool_clean(run)


def test_preemption_order_is_not_an_option() -> None:
    # Removed: "oldest" picked the wrong victim and no engine setting reached it.
    with pytest.raises(TypeError):
        SchedulerConfig(preemption_order="oldest")  # type: ignore[call-arg]


def test_blocked_head_of_line_counts_its_prefix_hit_once(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = SchedulerConfig(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64, page_size=4)
    run = make(cfg, num_pages=20)
    s = run.policy
    assert s.cache is not None
    cached = list(range(1, 10))
    s.add(req("c", cached, 1))
    drain(run)  # 8 tokens (2 pages) cached
    s.add(req("a", list(range(20, 60)), 20))
    step(run)  # a holds 10 of the 18 free pages, and grows
    b_prompt = cached[:8] + [(j * 7) % VOCAB for j in range(42)]
    s.add(req("b", b_prompt, 4))  # needs 11 pages beyond its 2 cached ones: not before a ends
    queries, hits = s.stats.prefix_queries_tokens, s.stats.prefix_hit_tokens
    assert (queries, hits) == (9 + 40, 0)
    calls: list[str] = []

    def spy(obj: object, name: str) -> None:
        real = getattr(obj, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return real(*args, **kwargs)
        monkeypatch.setattr(obj, name, wrapper)

    for obj, name in ((s.cache, "insert"), (s.cache, "evict"), (s.allocator, "incref")):
        spy(obj, name)
    for _ in range(5):
        step(run)
        assert s.waiting and s.waiting[0].request_id == "b"
        # Nothing counted, locked, referenced, inserted or evicted for b while it waits.
        assert (s.stats.prefix_queries_tokens, s.stats.prefix_hit_tokens) == (queries, hits)
        assert s.cache.num_locked_pages == 0 and s.requests["b"].pages == []
    assert calls == []
    monkeypatch.undo()
    drain(run)
    assert run.finished["b"].num_cached_tokens == 8
    assert (s.stats.prefix_queries_tokens, s.stats.prefix_hit_tokens) == (9 + 40 + 50, 8)
    assert run.finished["b"].output_token_ids == reference_generate(b_prompt, 4, VOCAB)
    assert_pool_clean(run)


def test_eviction_frees_pages_before_preempting_despite_shared_ones() -> None:
    # g#1 shares g#0's prompt pages; once g#0 ends they are also the tree's
    # least recently used leaf, yet evicting it frees nothing while g#1 runs.
    # The scheduler must go on to the next leaf rather than preempt.
    cfg = SchedulerConfig(max_model_len=32, max_num_seqs=4, max_num_batched_tokens=64, page_size=4)
    run = make(cfg, num_pages=10)
    s = run.policy
    assert s.cache is not None
    g = list(range(1, 18))  # 17 tokens: 4 full pages shared with the sibling
    s.add(req("g#0", g, 1))
    s.add(req("g#1", g, 12), share_prompt_with="g#0")
    step(run)  # g#0 computes the prompt and ends; its 4 full pages go to the tree, still held by g#1
    x = list(range(40, 49))
    s.add(req("x", x, 1))
    step(run)  # g#1 starts from the shared pages; x ends: a second, newer leaf of 2 pages
    assert s.cache.num_evictable_pages == 4 + 2
    y = list(range(60, 72))  # 12 tokens: the last 3 free pages
    s.add(req("y", y, 4))
    step(run)
    assert s.allocator.num_free_pages == 0
    step(run)  # y's first decode needs a page: only evicting x's leaf frees one
    assert s.stats.num_preemptions == 0
    drain(run)
    assert s.stats.num_preemptions == 0
    for rid, prompt, n in (("g#0", g, 1), ("g#1", g, 12), ("x", x, 1), ("y", y, 4)):
        assert run.finished[rid].output_token_ids == reference_generate(prompt, n, VOCAB)
    assert_pool_clean(run)


def test_a_prefix_match_inside_a_key_pins_only_its_own_pages() -> None:
    # A cached 15-token key holds 15 of 24 pages, another 7, 2 are free; a request
    # sharing only the first token of the long key needs 10 more pages. Locking the
    # whole long key would leave 9 to be had and the request would wait forever: the
    # match locks its one page (the key is split there) and the tail is evicted.
    cfg = SchedulerConfig(max_model_len=24, max_num_seqs=2, max_num_batched_tokens=32, page_size=1)
    run = make(cfg, num_pages=24)
    s = run.policy
    assert s.cache is not None
    cached = list(range(1, 17))
    s.add(req("c", cached[:15], 1))
    drain(run)
    s.add(req("hog", [90] * 7, 1))
    drain(run)
    assert s.allocator.num_free_pages == 2
    prompt = [1] + [50 + j for j in range(10)]
    s.add(req("b", prompt, 1))
    assert step(run) is not None  # admitted at once (it was never admitted before)
    drain(run)
    assert run.finished["b"].output_token_ids == reference_generate(prompt, 1, VOCAB)
    assert_pool_clean(run)
