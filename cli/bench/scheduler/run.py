"""``flotilla bench scheduler``: the Python cost of scheduling, without a model.

Measures the median wall time of one ``schedule()`` + ``update()`` step with
N requests decoding, and of ``match_prefix`` for a long prompt against a
large radix tree. Prints JSON.
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

from kvcache.page_allocator import PageAllocator
from kvcache.radix_cache import RadixCache
from scheduling.batch import StepOutput, TokenLogprobs
from scheduling.policy import BatchPolicy
from scheduling.request import Request
from scheduling.sampling_params import SamplingParams
from scheduling.scheduler_config import SchedulerConfig


def bench_decode_step(num_running: int, *, num_steps: int = 200, page_size: int = 16) -> dict[str, Any]:
    """Median seconds of schedule()+update() with ``num_running`` sequences decoding."""
    prompt_len = 128
    # Long enough that nobody finishes while the others are still being prefilled.
    max_tokens = num_steps + num_running + 64
    pages_per_seq = -(-(prompt_len + max_tokens) // page_size)
    cfg = SchedulerConfig(
        max_model_len=prompt_len + max_tokens, max_num_seqs=num_running,
        max_num_batched_tokens=max(num_running, prompt_len * 8), page_size=page_size,
    )
    sched = BatchPolicy(cfg, PageAllocator(pages_per_seq * num_running + 16))
    rng = random.Random(0)
    for i in range(num_running):
        prompt = [rng.randrange(256) for _ in range(prompt_len)]
        sched.add(Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0)))
    # Prefill everything first so the timed steps are pure decodes.
    while len(sched.running) < num_running or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in sched.running
    ):
        batch = sched.schedule()
        assert batch is not None
        sched.update(batch, StepOutput([7] * len(batch.sample_indices), [None] * len(batch.sample_indices)))
    tokens = [7] * num_running
    logprobs: list[TokenLogprobs | None] = [None] * num_running
    times: list[float] = []
    for _ in range(num_steps):
        t0 = time.perf_counter()
        batch = sched.schedule()
        assert batch is not None and batch.num_seqs == num_running and batch.is_decode_only
        sched.update(batch, StepOutput(tokens, logprobs))
        times.append(time.perf_counter() - t0)
    return {
        "running": num_running,
        "median_ms": round(statistics.median(times) * 1e3, 4),
        "p90_ms": round(sorted(times)[int(0.9 * len(times))] * 1e3, 4),
        "steps": num_steps,
    }


def bench_match_prefix(
    *, tree_tokens: int = 1_000_000, prompt_len: int = 4096, page_size: int = 16, repeats: int = 200
) -> dict[str, Any]:
    """Median seconds of match_prefix for ``prompt_len`` tokens against a tree of ``tree_tokens``."""
    rng = random.Random(1)
    allocator = PageAllocator(tree_tokens // page_size + 2 * prompt_len // page_size)
    cache = RadixCache(allocator, page_size)
    # Sequences share prefixes of random lengths, so the tree branches at many depths.
    seqs: list[list[int]] = []
    while cache.num_cached_pages * page_size < tree_tokens:
        if seqs and rng.random() < 0.7:
            base = rng.choice(seqs)
            cut = rng.randrange(0, prompt_len // page_size) * page_size
            seq = base[:cut] + [rng.randrange(32000) for _ in range(prompt_len - cut)]
        else:
            seq = [rng.randrange(32000) for _ in range(prompt_len)]
        seqs.append(seq)
        pages = allocator.allocate(prompt_len // page_size)
        cache.insert(seq, pages)
        allocator.free(pages)
    probes = [rng.choice(seqs)[:-page_size] + [rng.randrange(32000) for _ in range(page_size)] for _ in range(16)]
    times: list[float] = []
    matched = 0
    for i in range(repeats):
        probe = probes[i % len(probes)]
        t0 = time.perf_counter()
        m = cache.match_prefix(probe)
        times.append(time.perf_counter() - t0)
        matched = m.num_tokens
    return {
        "tree_tokens": cache.num_cached_pages * page_size,
        "prompt_tokens": prompt_len,
        "matched_tokens": matched,
        "median_ms": round(statistics.median(times) * 1e3, 4),
        "repeats": repeats,
    }


def run(sizes: tuple[int, ...] = (64, 256, 1024), num_steps: int = 200) -> dict[str, Any]:
    steps = [bench_decode_step(n, num_steps=num_steps) for n in sizes]
    match = bench_match_prefix()
    return {
        "benchmark": "scheduler",
        "step": steps,
        "match_prefix": match,
        "targets": {"step_ms_at_256": 1.0, "match_prefix_ms": 0.5},
        "meets_targets": {
            "step_ms_at_256": all(s["median_ms"] <= 1.0 for s in steps if s["running"] == 256),
            "match_prefix_ms": match["median_ms"] <= 0.5,
        },
    }
