"""``flotilla bench spec`` and ``flotilla bench spec-workloads``: command lines.

    flotilla bench spec-workloads --out-dir .bench/spec              # edit.jsonl, questions.jsonl
    flotilla bench spec --model smollm2-135m --workload .bench/spec/edit.jsonl \\
        --speculative-config '{"method": "ngram", "num_speculative_tokens": 3}' --json

The run is ``run``; the chat workloads ``workloads``.
"""

from __future__ import annotations

import argparse
import json

from cli.bench.engine_options import engine_options
from cli.bench.spec.workloads import write_workloads

EXAMPLE_SPEC = '{"method": "ngram", "num_speculative_tokens": 3}'


class SpecBench:
    name = "spec"
    help = "a workload without and with speculative decoding"

    def add_arguments(self, sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--model", default="tiny", help="model folder, .gguf file, hub id, tiny/small, or smollm2-135m")
        sp.add_argument("--workload", required=True,
                        help="JSONL file: token-id lines (make_workload.py) and/or chat lines ({\"messages\": ...})")
        sp.add_argument("--speculative-config", required=True,
                        help=f"JSON of the speculative engine, e.g. '{EXAMPLE_SPEC}'")
        sp.add_argument("--runs", type=int, default=3, help="alternating baseline/spec runs (medians reported)")
        sp.add_argument("--max-num-seqs", type=int, default=1,
                        help="concurrent sequences (default 1: batch 1, where speculation pays most)")
        sp.add_argument("--max-model-len", type=int, default=2048)
        sp.add_argument("--max-num-batched-tokens", type=int, default=2048)
        sp.add_argument("--num-kv-pages", type=int, default=None)
        sp.add_argument("--kv-cache-memory-fraction", type=float, default=None)
        sp.add_argument("--dtype", default=None)
        sp.add_argument("--cpu-threads", type=int, default=None,
                        help="torch threads of the forward (default: every core)")
        sp.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=False,
                        help="off by default, like bench offline (runs repeat the same prompts)")
        sp.add_argument("--progress", action="store_true", help="show a progress bar on stderr")
        sp.add_argument("--json", action="store_true", help="print one JSON object instead of the table")

    def run(self, args: argparse.Namespace) -> int:
        from cli.bench.spec.run import format_table, run  # import cost (cli.bench.registry)

        engine = engine_options(args, ("num_kv_pages", "kv_cache_memory_fraction", "dtype", "cpu_threads"))
        result = run(args.model, args.workload, speculative_config=args.speculative_config, runs=args.runs,
                     progress=args.progress, **engine)
        print(json.dumps(result) if args.json else format_table(result))
        return 0


class SpecWorkloadsBench:
    name = "spec-workloads"
    help = "write the edit and questions chat workloads"

    def add_arguments(self, wl: argparse.ArgumentParser) -> None:
        wl.add_argument("--out-dir", required=True, help="folder for edit.jsonl and questions.jsonl")
        wl.add_argument("--num-requests", type=int, default=16, help="requests in each workload")
        wl.add_argument("--seed", type=int, default=0)

    def run(self, args: argparse.Namespace) -> int:
        paths = write_workloads(args.out_dir, num_requests=args.num_requests, seed=args.seed)
        print(json.dumps({"seed": args.seed, "num_requests": args.num_requests, **paths}))
        return 0
