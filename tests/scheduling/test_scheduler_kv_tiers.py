"""The scheduler's side of the KV tiers: pages queued for saving stay pinned until their step is settled, a step
runs for saves alone, loaded blocks extend a radix match, and a load's pages never reach the tree unwritten."""

from __future__ import annotations

import torch

from kvcache.kv_transfer import KVPayload
from scheduling.batch import StepOutput
from scheduling.kv_tiers import MAX_SAVE_PAGES
from scheduling.request import Request, RequestStatus, TierHit
from scheduling.sampling_params import SamplingParams
from scheduling.scheduler_config import SchedulerConfig
from tests.scheduling.driver import assert_pool_clean, drain, make, step

PS = 4
CONFIG = SchedulerConfig(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64, page_size=PS)
GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


class SaveAll:
    """A ``KVSaver`` that picks every page, keyed by (first token, page index)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def select(self, namespace: str | None, token_ids: list[int], first_page: int,
               num_pages: int) -> list[tuple[int, bytes]]:  # fmt: skip
        self.calls.append((first_page, num_pages))
        return [(i, bytes([token_ids[0] % 256, i])) for i in range(first_page, first_page + num_pages)]


def _req(rid: str, n: int, first: int = 1) -> Request:
    return Request(rid, [first + j % 50 for j in range(n)], GREEDY)


def _payload(num_pages: int) -> KVPayload:
    t = torch.zeros(num_pages, PS, 1, 2)
    return KVPayload(k=(t,), v=(t,), k_scales=None, v_scales=None, kv_dtype="auto", dtype="float32")


def test_saved_pages_stay_pinned_until_their_step_is_settled() -> None:
    run = make(CONFIG, 32)
    s = run.policy
    saver = SaveAll()
    s.kv.saver = saver
    s.add(_req("a", 18))
    while "a" not in run.finished:
        step(run)
    # 20 computed tokens (18 + 2 of 3 outputs): five full pages, new to the tree, queued.
    assert saver.calls == [(0, 5)] and len(s.kv.saves) == 5
    assert s.has_work  # a step must still copy them out
    assert s.cache is not None
    s.cache.reset()  # evicted from the tree: the queue's references keep them off the free list
    assert s.allocator.num_free_pages == 32 - 5
    batch = s.schedule()
    assert batch is not None and batch.num_seqs == 0  # a step for the saves alone
    assert batch.kv_moves.saves is not None and len(batch.kv_moves.saves) == 5
    assert batch.kv_moves.save_keys == [bytes([1, i]) for i in range(5)]
    s.update(batch, StepOutput([], []))
    assert not s.has_work and s.allocator.num_free_pages == 32
    assert_pool_clean(run)


def test_a_burst_of_saves_spreads_over_steps() -> None:
    config = SchedulerConfig(max_model_len=2048, max_num_seqs=4, max_num_batched_tokens=2048, page_size=PS)
    run = make(config, 1024)
    run.policy.kv.saver = SaveAll()
    for i in range(3):
        run.policy.add(_req(f"r{i}", 400, first=i + 1))
    drain(run)
    sizes = [len(b.kv_moves.saves or []) for b in run.batches]
    assert max(sizes, default=0) <= MAX_SAVE_PAGES
    assert_pool_clean(run)


def test_a_failed_save_step_still_drops_its_pins() -> None:
    run = make(CONFIG, 32)
    s = run.policy
    s.kv.saver = SaveAll()
    s.add(_req("a", 18))
    while "a" not in run.finished:
        step(run)
    batch = s.schedule()
    assert batch is not None and batch.kv_moves.saves
    s.update(batch, StepOutput([], []))  # what the engine's fail path does: settle with no output
    assert_pool_clean(run)


def test_loaded_blocks_extend_the_radix_match() -> None:
    run = make(CONFIG, 32)
    s = run.policy
    req = _req("a", 22)  # five full pages, the last token left to compute
    req.kv_moves.loaded = TierHit(0, (_payload(5),))
    s.add(req)
    batch = s.schedule()
    assert batch is not None and batch.kv_moves.imports is not None
    (pages, payloads), = batch.kv_moves.imports
    assert pages == req.pages[:5] and payloads[0].num_pages == 5
    assert batch.query_lens == [2] and batch.positions == [20, 21]  # only the tokens past the blocks
    assert req.num_cached_tokens == 20 and s.stats.tier_hit_tokens == 20
    assert req.kv_moves.loaded is None and req.kv_moves.tier_unwritten


def test_pages_of_a_load_never_reach_the_tree_unwritten() -> None:
    run = make(CONFIG, 32)
    s = run.policy
    req = _req("a", 22)
    req.kv_moves.loaded = TierHit(0, (_payload(5),))
    s.add(req)
    batch = s.schedule()
    assert batch is not None and batch.kv_moves.imports
    s.abort("a")  # while its step runs: the imported pages hold nothing yet
    assert s.cache is not None and s.cache.num_cached_pages == 0
    s.update(batch, StepOutput([0], [None]))
    assert req.status is RequestStatus.ABORTED
    assert_pool_clean(run)


def test_a_request_waits_for_its_load_and_those_behind_it_go_on() -> None:
    run = make(CONFIG, 32)
    s = run.policy
    first, second = _req("a", 10), _req("b", 10, first=7)
    first.kv_moves.loading = True
    s.add(first)
    s.add(second)
    batch = step(run)
    assert batch is not None and s.running == [second] and list(s.waiting) == [first]
    first.kv_moves.loading = False  # its load ended: it is admitted at the next plan
    step(run)
    assert first in s.running
    drain(run)
    assert set(run.finished) == {"a", "b"}
    assert_pool_clean(run)


def test_blocks_that_no_longer_join_the_match_are_dropped() -> None:
    """A load that starts past what the tree holds now (its pages were evicted meanwhile) cannot be used."""
    run = make(CONFIG, 32)
    s = run.policy
    req = _req("a", 22)
    req.kv_moves.loaded = TierHit(2, (_payload(3),))  # blocks 2..4, but the tree holds none of 0..1
    s.add(req)
    batch = step(run)
    assert batch is not None and batch.kv_moves.imports is None and batch.query_lens == [22]
    drain(run)
    assert_pool_clean(run)
