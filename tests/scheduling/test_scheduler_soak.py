"""Soak: thousands of random requests, random aborts, a pool that forces preemption."""

from __future__ import annotations

import random

import pytest

from scheduling.request import Request
from scheduling.sampling_params import SamplingParams
from scheduling.scheduler_config import SchedulerConfig
from tests.scheduling.driver import VOCAB, assert_pool_clean, make, step
from tests.scheduling.fake_runner import reference_generate

STOP = 13


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_soak_random_arrivals_aborts_and_preemption(prefix_caching: bool) -> None:
    rng = random.Random(1234 if prefix_caching else 4321)
    num_requests = 2000
    cfg = SchedulerConfig(
        max_model_len=512, max_num_seqs=48, max_num_batched_tokens=256, page_size=8,
        enable_prefix_caching=prefix_caching,
    )
    # 48 sequences of up to ~300 tokens would need ~1,800 pages: 160 forces preemption.
    run = make(cfg, num_pages=160)
    s = run.policy
    shared = [[rng.randrange(VOCAB) for _ in range(rng.randint(8, 120))] for _ in range(6)]
    specs: dict[str, tuple[list[int], int, bool]] = {}
    pending: list[Request] = []
    for i in range(num_requests):
        body = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 150))]
        prompt = (rng.choice(shared) + body) if rng.random() < 0.4 else body
        max_tokens = rng.randint(1, 64)
        use_stop = rng.random() < 0.3
        params = SamplingParams(max_tokens=max_tokens, stop_token_ids=[STOP] if use_stop else [])
        rid = f"r{i}"
        specs[rid] = (prompt, max_tokens, use_stop)
        pending.append(Request(rid, prompt, params))
    aborted: set[str] = set()
    abort_at: dict[int, list[str]] = {}  # step -> ids to abort then (if still live)
    steps = 0
    while pending or s.has_work:
        for _ in range(rng.randint(0, 6)):  # bursty arrivals
            if pending:
                r = pending.pop(0)
                s.add(r)
                if rng.random() < 0.12:
                    abort_at.setdefault(steps + rng.randint(0, 80), []).append(r.request_id)
        for rid in abort_at.pop(steps, []):
            if s.abort(rid) is not None:
                aborted.add(rid)
        step(run)
        steps += 1
        assert steps < 200_000
        if steps % 97 == 0:
            s.allocator.check_integrity()
            if s.cache is not None:
                s.cache.check_integrity()
    assert 0.05 * num_requests < len(aborted) < 0.2 * num_requests
    assert s.stats.num_preemptions > 50
    done = 0
    for rid, (prompt, max_tokens, use_stop) in specs.items():
        if rid in aborted:
            assert rid not in run.finished
            continue
        expected = reference_generate(prompt, max_tokens, VOCAB, (STOP,) if use_stop else ())
        got = run.finished[rid]
        assert got.output_token_ids == expected, rid
        assert got.finish_reason == ("stop" if expected[-1] == STOP and use_stop else "length")
        done += 1
    assert done + len(aborted) == num_requests
    assert not s.requests
    assert_pool_clean(run)
