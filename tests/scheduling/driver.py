"""Drives a BatchPolicy with the fake runner and checks per-step invariants."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvcache.page_allocator import PageAllocator
from scheduling.batch import Batch
from scheduling.policy import BatchPolicy
from scheduling.request import Request
from scheduling.scheduler_config import SchedulerConfig
from tests.scheduling.fake_runner import FakeModelRunner

VOCAB = 97


@dataclass
class Run:
    policy: BatchPolicy
    runner: FakeModelRunner
    finished: dict[str, Request] = field(default_factory=dict)
    batches: list[Batch] = field(default_factory=list)
    computed_tokens: int = 0


def make(config: SchedulerConfig, num_pages: int) -> Run:
    allocator = PageAllocator(num_pages)
    return Run(BatchPolicy(config, allocator), FakeModelRunner(num_pages, config.page_size, VOCAB))


def step(run: Run, keep_batches: bool = False) -> Batch | None:
    s = run.policy
    batch = s.schedule()
    if batch is None:
        return None
    cfg = s.config
    assert batch.num_tokens <= cfg.max_num_batched_tokens, "token budget exceeded"
    assert batch.num_seqs <= cfg.max_num_seqs, "max_num_seqs exceeded"
    assert len(batch.input_ids) == len(batch.positions) == sum(batch.query_lens)
    run.computed_tokens += batch.num_tokens
    update = s.update(batch, run.runner.execute(batch))
    for req in update.finished:
        run.finished[req.request_id] = req
    if keep_batches:
        run.batches.append(batch)
    return batch


def drain(run: Run, on_step: Callable[[int], None] | None = None, max_steps: int = 1_000_000) -> None:
    for i in range(max_steps):
        if on_step is not None:
            on_step(i)
        if not run.policy.has_work:
            return
        step(run)
    raise AssertionError("scheduler did not drain")


def assert_pool_clean(run: Run) -> None:
    """Every page is free or held by the radix tree alone; evicting all frees the pool."""
    s = run.policy
    alloc = s.allocator
    alloc.check_integrity()
    cached = s.cache.num_cached_pages if s.cache is not None else 0
    assert alloc.num_free_pages + cached == alloc.num_pages
    if s.cache is not None:
        s.cache.check_integrity()
        assert s.cache.num_locked_pages == 0
        s.cache.reset()
    assert alloc.num_free_pages == alloc.num_pages
