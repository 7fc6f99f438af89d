"""Speculative decoding on CUDA (torch paged attention): greedy agreement and speed, tiny and small.

Run on a machine with a CUDA device, from the repo root: ``python scripts/gpu_spec_check.py``.
For each model (tiny, small) and dtype (float32, bfloat16), each method (prompt lookup, a
self-draft from the first 2 layers) against no speculation: whether the greedy outputs of 1
and of 32 repetitive prompts are identical, medians of 3 timed runs, and that every KV page is
free afterwards. Prints one JSON line per case and writes ``$OUT/spec_check.json``.
"""

import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.getcwd())

import torch  # noqa: E402

from apps.llm import LLM  # noqa: E402
from scheduling.sampling_params import SamplingParams  # noqa: E402

out_dir = os.environ.get("OUT", ".")
rng = random.Random(0)
motifs = [[rng.randrange(3, 250) for _ in range(rng.randint(3, 8))] for _ in range(32)]
PROMPTS = [(m * 20)[:rng.randint(40, 120)] for m in motifs]
GREEDY = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
CONFIGS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4},
    "self_draft": {"method": "draft", "layers": 2, "num_speculative_tokens": 3},
}
results = {"gpu": torch.cuda.get_device_name(0), "cases": []}


def timed(llm, prompts):
    torch.cuda.synchronize()
    t = time.perf_counter()
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    toks = [o.outputs[0].token_ids for o in outs]
    return toks, sum(len(x) for x in toks) / dt


for model in ("tiny", "small"):
    for dtype in ("float32", "bfloat16"):
        base = LLM(model, dtype=dtype, device="cuda", max_num_seqs=32, max_model_len=1024, num_kv_pages=4096)
        base.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
        for name, cfg in CONFIGS.items():
            spec = LLM(model, dtype=dtype, device="cuda", max_num_seqs=32, max_model_len=1024, num_kv_pages=4096,
                       speculative_config={**cfg, "disable_by_batch_size": None})
            spec.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
            for bs_prompts, label in ((PROMPTS[:1], "batch1"), (PROMPTS, "batch32")):
                b_runs, s_runs = [], []
                for _ in range(3):
                    bt, btps = timed(base, bs_prompts)
                    st, stps = timed(spec, bs_prompts)
                    b_runs.append(btps)
                    s_runs.append(stps)
                same = sum(x == y for x, y in zip(bt, st, strict=True))
                first_diff = [next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), None) for x, y in zip(bt, st, strict=True)]
                stats = spec.engine.policy.stats
                case = {"model": model, "dtype": dtype, "method": name, "load": label,
                        "same_outputs": f"{same}/{len(bt)}",
                        "first_diff_positions": [d for d in first_diff if d is not None][:8],
                        "baseline_tok_s": round(statistics.median(b_runs), 1),
                        "spec_tok_s": round(statistics.median(s_runs), 1),
                        "acceptance": round(stats.spec_acceptance_rate, 3)}
                print(json.dumps(case), flush=True)
                results["cases"].append(case)
            e = spec.engine
            cache = e.policy.cache
            free = e.allocator.num_free_pages + (cache.num_evictable_pages if cache else 0)
            assert free == e.allocator.num_pages, (free, e.allocator.num_pages)
            spec.shutdown()
        base.shutdown()

with open(os.path.join(out_dir, "spec_check.json"), "w") as f:
    json.dump(results, f, indent=1)
