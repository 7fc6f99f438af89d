"""Embedding requests in the scheduler: the prefill path without sampling, prefix lookups or cached pages.

The fake runner writes every scheduled token into its pages as a model would;
what these tests check is the scheduler's side: which sequences a ``Batch``
pools and samples, when an embedding request ends, the rows and chunk starts
``PolicyUpdate.pooled`` reports (preemption included), and that its pages
go back to the allocator rather than into the prefix cache.
"""

from __future__ import annotations

import pytest

from scheduling.batch import Batch
from scheduling.errors import InvalidParameterError
from scheduling.policy import PolicyUpdate
from scheduling.pooling import Pooling
from scheduling.request import Request, RequestStatus
from scheduling.sampling_params import SamplingParams
from scheduling.scheduler_config import SchedulerConfig
from tests.scheduling.driver import VOCAB, Run, assert_pool_clean, drain, make
from tests.scheduling.fake_runner import reference_generate


def embedding(rid: str, prompt: list[int], mode: str = "mean") -> Request:
    return Request(rid, prompt, SamplingParams(pooling=Pooling(mode)))  # type: ignore[arg-type]


def generating(rid: str, prompt: list[int], max_tokens: int) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens))


def prompt_of(length: int, salt: int = 0) -> list[int]:
    return [(salt * 31 + j * 7 + 3) % VOCAB for j in range(length)]


def one_step(run: Run) -> tuple[Batch, list[Request], PolicyUpdate]:
    """Schedule, run and settle one step; also the step's requests, in the batch's sequence order."""
    s = run.policy
    batch = s.schedule()
    assert batch is not None
    reqs = s.requests_in_step(batch.step)
    update = s.update(batch, run.runner.execute(batch))
    for req in update.finished:
        run.finished[req.request_id] = req
    return batch, reqs, update


@pytest.mark.parametrize("mode", ["mean", "last"])
def test_a_chunked_embedding_is_pooled_per_chunk_never_sampled_and_ends_with_its_prompt(mode: str) -> None:
    cfg = SchedulerConfig(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=8, page_size=4)
    run = make(cfg, num_pages=40)
    s = run.policy
    s.add(generating("g", prompt_of(5, 1), 6))
    s.add(embedding("e", prompt_of(20), mode))
    starts: list[int] = []
    while s.has_work:
        batch, reqs, update = one_step(run)
        ids = [r.request_id for r in reqs]
        if "e" in ids:
            assert ids.index("e") not in batch.sample_indices  # never sampled, so never given logits
        for req, j, first in update.pooled:
            assert req.request_id == "e" and batch.pooling.indices is not None
            assert batch.pooling.indices[j] == ids.index("e") and batch.pooling.means == [mode == "mean"]
            starts.append(first)
    # g's prompt (5) and decodes share each 8-token step: e computes 3, 7, 7, 3 tokens.
    # Mean pools every chunk; last only the one that ends the prompt.
    assert starts == ([0, 3, 10, 17] if mode == "mean" else [17])
    e = run.finished["e"]
    assert (e.status, e.finish_reason, e.output_token_ids) == (RequestStatus.FINISHED, "stop", [])
    assert run.finished["g"].output_token_ids == reference_generate(prompt_of(5, 1), 6, VOCAB)
    assert s.cache is not None and s.cache.num_cached_pages == 2  # g's 10 computed tokens: 2 full pages; e none
    assert_pool_clean(run)


def test_an_embedding_reads_no_cached_prefix_and_leaves_none() -> None:
    cfg = SchedulerConfig(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64, page_size=4)
    run = make(cfg, num_pages=40)
    s = run.policy
    assert s.cache is not None
    prompt = prompt_of(17)
    s.add(generating("g1", prompt, 1))
    drain(run)
    cached = s.cache.num_cached_pages
    assert cached == 4
    s.add(embedding("e1", prompt))
    batch, _, update = one_step(run)
    assert batch.query_lens == [17] and [first for _, _, first in update.pooled] == [0]  # all 17 rows computed
    assert run.finished["e1"].num_cached_tokens == 0 and s.stats.prefix_hit_tokens == 0
    assert s.cache.num_cached_pages == cached  # nothing of e1's went into the tree
    s.add(embedding("e2", prompt_of(12, 2)))
    drain(run)
    s.add(generating("g2", prompt_of(12, 2), 1))
    drain(run)
    assert run.finished["g2"].num_cached_tokens == 0  # e2's pages were freed, not cached
    assert_pool_clean(run)


def test_a_preempted_embedding_restarts_its_pooling_from_the_first_token() -> None:
    # g (12 + 20 tokens) grows to all 8 pages; e, admitted after it, is the newest: each time the two
    # outgrow the pool e is preempted, and it recomputes its prompt from the start.
    cfg = SchedulerConfig(max_model_len=32, max_num_seqs=2, max_num_batched_tokens=8, page_size=4,
                          enable_prefix_caching=False)
    run = make(cfg, num_pages=8)
    s = run.policy
    s.add(generating("g", prompt_of(12, 1), 20))
    s.add(embedding("e", prompt_of(24)))
    starts: list[int] = []
    while s.has_work:
        _, _, update = one_step(run)
        starts += [first for _, _, first in update.pooled]
    e = run.finished["e"]
    assert e.num_preemptions >= 1 and s.stats.num_preemptions == e.num_preemptions
    assert starts.count(0) == e.num_preemptions + 1  # every restart pools afresh from token 0
    last_run = starts[len(starts) - 1 - starts[::-1].index(0):]
    assert last_run == sorted(last_run) and e.finish_reason == "stop"
    assert run.finished["g"].output_token_ids == reference_generate(prompt_of(12, 1), 20, VOCAB)
    assert_pool_clean(run)


def test_an_aborted_embedding_frees_its_pages_and_reports_no_row() -> None:
    cfg = SchedulerConfig(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=8, page_size=4)
    run = make(cfg, num_pages=40)
    s = run.policy
    s.add(embedding("e", prompt_of(30)))
    one_step(run)
    batch = s.schedule()
    assert batch is not None and batch.pooling.indices == [0]
    aborted = s.abort("e")  # while the step runs: its row comes back, for no one
    assert aborted is not None and aborted.status is RequestStatus.ABORTED
    update = s.update(batch, run.runner.execute(batch))
    assert update.pooled == [] and update.finished == []
    assert s.cache is not None and s.cache.num_cached_pages == 0
    assert_pool_clean(run)


def test_an_embedding_prompt_may_fill_max_model_len_and_ignores_max_tokens() -> None:
    cfg = SchedulerConfig(max_model_len=16, max_num_seqs=2, max_num_batched_tokens=16, page_size=4)
    run = make(cfg, num_pages=8)
    s = run.policy
    s.add(Request("e", prompt_of(16), SamplingParams(max_tokens=100, pooling=Pooling("last"))))
    drain(run)
    assert run.finished["e"].finish_reason == "stop"
    with pytest.raises(InvalidParameterError, match="max_model_len") as err:
        s.add(generating("g", prompt_of(16), 1))  # a generating request needs room for one token
    assert err.value.param == "prompt"
    assert_pool_clean(run)
