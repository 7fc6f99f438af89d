"""``flotilla bench accuracy``: command line.

    flotilla bench spec-workloads --out-dir .bench/spec --num-requests 20   # questions.jsonl: open chat prompts
    flotilla bench accuracy --model smollm2-135m --workload .bench/spec/questions.jsonl \\
        --against '{"kv_cache_dtype": "int8"}' --json

The run is ``run``; the teacher-forced figures ``forced``, where greedy
outputs part ``divergence``.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

EXAMPLE_AGAINST = '{"kv_cache_dtype": "int8"}'
# Far above one max_model_len sequence of the models we run, so both configs hold hundreds of pages.
DEFAULT_KV_BUDGET_MIB = 1024
# Engine options that have a flag here; each is passed only when given (``--base`` may set it instead).
ENGINE_FLAGS = ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "dtype", "enable_prefix_caching")


class AccuracyBench:
    name = "accuracy"
    help = ("greedy and token-level agreement, KL, perplexity ratio, KV pages and speed of a config "
            "against a base config")

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--model", default="tiny", help="model folder, .gguf file, hub id, tiny/small, or smollm2-135m")
        p.add_argument("--workload", required=True,
                       help="JSONL file: chat lines ({\"messages\": ...}, e.g. bench spec-workloads' questions.jsonl) "
                            "and/or token-id lines")
        p.add_argument("--against", required=True,
                       help=f"JSON object of engine options that update the base config, e.g. '{EXAMPLE_AGAINST}'")
        p.add_argument("--base", default=None, help="JSON object of engine options of the base config (default: none)")
        p.add_argument("--kv-budget-mib", type=int, default=DEFAULT_KV_BUDGET_MIB,
                       help="the fixed memory in which kv_pages of both configs are counted (MiB)")
        p.add_argument("--batch1-tokens", type=int, default=64,
                       help="tokens of the lone-request run (batch-1 decode tok/s, decode_speedup); 0 skips it")
        p.add_argument("--max-tokens", type=int, default=None,
                       help="cap every request's max_tokens at this (default: the workload's)")
        p.add_argument("--heldout", default=None,
                       help="text file of perplexity_ratio (default: the shipped public-domain prose, "
                            "cli/bench/data/heldout_prose.txt)")
        p.add_argument("--max-model-len", type=int, default=None)
        p.add_argument("--max-num-seqs", type=int, default=None)
        p.add_argument("--max-num-batched-tokens", type=int, default=None)
        p.add_argument("--dtype", default=None)
        p.add_argument("--prefix-caching", dest="enable_prefix_caching", action=argparse.BooleanOptionalAction,
                       default=None, help="off unless given (the warm-up repeats the first prompts)")
        p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                       help="phase lines and progress bars on stderr")
        p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")

    def run(self, args: argparse.Namespace) -> int:
        from cli.bench.accuracy.run import run  # import cost (cli.bench.registry)

        flags = {name: getattr(args, name) for name in ENGINE_FLAGS if getattr(args, name) is not None}
        # Without --heldout, run's own default: one place names the shipped file.
        heldout = {} if args.heldout is None else {"heldout": args.heldout}
        result = run(args.model, args.workload, against=args.against, base=args.base, kv_budget_mib=args.kv_budget_mib,
                     batch1_tokens=args.batch1_tokens, progress=args.progress, max_tokens=args.max_tokens,
                     **heldout, **flags)
        print(json.dumps(result) if args.json else format_table(result))
        return 0


def format_table(result: dict[str, Any]) -> str:
    """A short table for a person (``--json`` prints the whole result instead)."""
    r, b, a, h = result, result["base"], result["against"], result["heldout"]
    changed = {k: v for k, v in r["against_config"].items() if r["base_config"].get(k, object()) != v}

    def row(name: str, key: str, fmt: str) -> str:
        cells = [format(x[key], fmt) if x[key] is not None else "-" for x in (b, a)]
        return f"{name:22}{cells[0]:>14}{cells[1]:>14}"

    return "\n".join([
        f"{r['model']} on {r['workload']}: {r['requests']} requests, {r['output_tokens']} base output tokens; "
        f"against {json.dumps(changed)}",
        f"{'':22}{'base':>14}{'against':>14}",
        row("output tok/s", "output_tok_per_s", ".1f"),
        row("batch-1 decode tok/s", "decode_tok_per_s", ".1f"),
        row("KV bytes per page", "kv_bytes_per_page", "d"),
        row(f"KV pages in {r['kv_budget_mib']} MiB", "kv_pages", "d"),
        row("weight bytes", "weight_bytes", "d"),
        f"greedy_agreement {r['greedy_agreement']:.3f}   mean_kl {r['mean_kl']:.3e}   max_kl {r['max_kl']:.3e}"
        f"   (over {r['output_tokens']} positions)",
        f"token_top1_agreement {r['token_top1_agreement']:.5f} ({r['token_top1_matches']} of the same positions)"
        f"   perplexity_ratio {r['perplexity_ratio']:.5f} ({h['against_perplexity']:.4f} / {h['base_perplexity']:.4f}"
        f" over {h['tokens']} held-out tokens; top-1 agreement there {h['top1_agreement']:.5f})",
        f"outputs part at base top-2 gaps {sorted(d['base_margin'] for d in r['divergences'] if d['base_margin'] is not None)}"
        f"; smallest gap per request {r['base_min_margin_quantiles']}",
        f"kv_pages_ratio {r['kv_pages_ratio']}   decode_speedup {r['decode_speedup']}"
        f"   output_tok_per_s_ratio {r['output_tok_per_s_ratio']}",
    ])
