"""``flotilla bench offline``: run a JSONL workload through the offline engine.

The workload format is ``../shared/peers/make_workload.py``'s: one request a
line, ``{"prompt_token_ids": [...], "max_tokens": N}``. Every request runs
greedily with ignore_eos, so each engine compared does exactly the same work.
Prints one JSON object.
"""

from __future__ import annotations

import resource
import sys
import time
from pathlib import Path
from typing import Any

from apps.llm import LLM
from cli.bench.workload import read_workload
from scheduling.sampling_params import SamplingParams


def peak_rss_mib() -> float:
    """Peak resident set size of this process (Linux reports KiB)."""
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(kib / 1024 if sys.platform != "darwin" else kib / 2**20, 1)


def run(model: str, workload: str | Path, *, progress: bool = False, **engine: Any) -> dict[str, Any]:
    reqs = read_workload(workload)
    llm = LLM(model=model, **engine)
    prompts = [r["prompt_token_ids"] for r in reqs]
    params = [SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True) for r in reqs]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up, as the peers do
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=progress)
    dt = time.perf_counter() - t0
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    cap = llm.engine.executor.capacity
    return {
        "engine": "flotilla",
        "model": model,
        "requests": len(reqs),
        "seconds": round(dt, 3),
        "output_tokens": out_tokens,
        "output_tok_per_s": round(out_tokens / dt, 1),
        "peak_rss_mib": peak_rss_mib(),
        "kv_pool_mib": round(cap.bytes / 2**20, 1),
        "first_tokens": [o.outputs[0].token_ids[:8] for o in outs[:4]],
    }
