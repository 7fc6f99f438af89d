"""``flotilla bench accuracy``: command line.

    flotilla bench spec-workloads --out-dir .bench/spec --num-requests 20   # questions.jsonl: open chat prompts
    flotilla bench accuracy --model smollm2-135m --workload .bench/spec/questions.jsonl \\
        --against '{"kv_cache_dtype": "int8"}' --json

The runner (torch, the engine) is imported only when the command runs, so
that ``flotilla --help`` stays fast.
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


def add_bench_accuracy_parser(bench_subparsers: Any) -> None:
    """Register ``accuracy`` on the ``flotilla bench`` subparsers."""
    p = bench_subparsers.add_parser(
        "accuracy", help="greedy agreement, KL, KV pages and speed of a config against a base config")
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
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--prefix-caching", dest="enable_prefix_caching", action=argparse.BooleanOptionalAction,
                   default=None, help="off unless given (the warm-up repeats the first prompts)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                   help="phase lines and progress bars on stderr")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(func=_bench_accuracy)


def _bench_accuracy(args: argparse.Namespace) -> int:
    from cli.bench.accuracy import format_table, run  # import cost (module docstring)

    flags = {name: getattr(args, name) for name in ENGINE_FLAGS if getattr(args, name) is not None}
    result = run(args.model, args.workload, against=args.against, base=args.base, kv_budget_mib=args.kv_budget_mib,
                 batch1_tokens=args.batch1_tokens, progress=args.progress, max_tokens=args.max_tokens, **flags)
    print(json.dumps(result) if args.json else format_table(result))
    return 0
