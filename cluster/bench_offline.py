"""``flotilla bench offline``: run a JSONL workload through the offline engine.

The workload format is ``../shared/peers/make_workload.py``'s: one request a
line, ``{"prompt_token_ids": [...], "max_tokens": N}``. Every request runs
greedily with ignore_eos, so each engine compared does exactly the same work.
Prints one JSON object.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

from scheduling.errors import InvalidParameterError


def read_workload(path: str | Path) -> list[dict[str, Any]]:
    """Parse and check a JSONL workload; a bad line is an error naming its number."""
    p = Path(path)
    if not p.is_file():
        raise InvalidParameterError("workload", f"{p} is not a file")
    reqs = []
    for lineno, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            ids, max_tokens = obj["prompt_token_ids"], obj["max_tokens"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise InvalidParameterError("workload", f"{p}:{lineno}: {e}") from e
        if not isinstance(ids, list) or not ids or not isinstance(max_tokens, int) or max_tokens < 1:
            raise InvalidParameterError("workload", f"{p}:{lineno}: need a non-empty prompt and max_tokens >= 1")
        reqs.append({"prompt_token_ids": ids, "max_tokens": max_tokens})
    if not reqs:
        raise InvalidParameterError("workload", f"{p} holds no requests")
    return reqs


def peak_rss_mib() -> float:
    """Peak resident set size of this process (Linux reports KiB)."""
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(kib / 1024 if sys.platform != "darwin" else kib / 2**20, 1)


def run(model: str, workload: str | Path, *, progress: bool = False, **engine: Any) -> dict[str, Any]:
    from apps.llm import LLM
    from scheduling.sampling_params import SamplingParams

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
