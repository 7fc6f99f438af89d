"""``flotilla bench offline``: run a JSONL workload through the offline engine.

The workload format is ``../shared/peers/make_workload.py``'s: one request a
line, ``{"prompt_token_ids": [...], "max_tokens": N}``. Every request runs
greedily with ignore_eos, so each engine compared does exactly the same work.

Then, unless ``batch1_tokens`` is 0, one lone request (``cli.bench.harness.batch1``):
a prompt of ``batch1_prompt_len`` token ids (the workload's first prompt,
repeated or cut), greedy, ``batch1_tokens`` tokens, run three times; its
batch-1 decode tok/s is the figure to set beside ``llama-bench``'s ``tg``.
``cpu_gemv`` says which kernel ran this process's float32 products of one or
two rows (``actors.models.cpu_linear``; null when the model loaded
none). Prints one JSON object.
"""

from __future__ import annotations

import resource
import sys
import time
from pathlib import Path
from typing import Any

from actors.models import cpu_linear
from apps.llm import LLM
from cli.bench.harness import WARMUP_REQUESTS, batch1
from cli.bench.workload import read_workload
from scheduling.sampling_params import SamplingParams


def peak_rss_mib() -> float:
    """Peak resident set size of this process (Linux reports KiB)."""
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(kib / 1024 if sys.platform != "darwin" else kib / 2**20, 1)


def run(model: str, workload: str | Path, *, progress: bool = False, batch1_prompt_len: int = 128,
        batch1_tokens: int = 64, **engine: Any) -> dict[str, Any]:
    reqs = read_workload(workload)
    llm = LLM(model=model, **engine)
    prompts = [r["prompt_token_ids"] for r in reqs]
    params = [SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True) for r in reqs]
    llm.generate(prompts[:WARMUP_REQUESTS], params[:WARMUP_REQUESTS], use_tqdm=False)
    steps0, forward0 = llm.engine.policy.stats.num_steps, llm.engine.forward_seconds_total
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=progress)
    dt = time.perf_counter() - t0
    steps = llm.engine.policy.stats.num_steps - steps0
    forward_s = llm.engine.forward_seconds_total - forward0
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    cap = llm.engine.executor.capacity
    extra: dict[str, Any] = {}
    if batch1_tokens > 0:
        first = prompts[0]
        extra["batch1"] = batch1(llm, (first * -(-batch1_prompt_len // len(first)))[:batch1_prompt_len],
                                 batch1_tokens)
    return {
        "engine": "flotilla",
        "model": model,
        "requests": len(reqs),
        "seconds": round(dt, 3),
        "output_tokens": out_tokens,
        "output_tok_per_s": round(out_tokens / dt, 1),
        "engine_steps": steps,
        "engine_forward_ms_per_step": round(forward_s * 1e3 / steps, 3) if steps else None,
        "peak_rss_mib": peak_rss_mib(),
        "kv_pool_mib": round(cap.bytes / 2**20, 1),
        "first_tokens": [o.outputs[0].token_ids[:8] for o in outs[:4]],
        "cpu_gemv": choice.report() if (choice := cpu_linear.current_few_rows_choice()) else None,
        **extra,
    }
