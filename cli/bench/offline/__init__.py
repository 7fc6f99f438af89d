"""``flotilla bench offline``: offline throughput on a JSONL workload (JSON); the runner is ``run``."""

from __future__ import annotations

import argparse
import json

from cli.bench.engine_options import engine_options


class OfflineBench:
    name = "offline"
    help = "offline throughput on a JSONL workload"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--model", default="tiny",
                            help="model folder, .gguf file, hub id, tiny/small, or smollm2-135m")
        parser.add_argument("--workload", required=True, help="JSONL file (make_workload.py format)")
        parser.add_argument("--max-num-seqs", type=int, default=64)
        parser.add_argument("--max-model-len", type=int, default=2048)
        parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
        parser.add_argument("--num-kv-pages", type=int, default=None)
        parser.add_argument("--kv-cache-memory-fraction", type=float, default=None)
        parser.add_argument("--dtype", default=None)
        parser.add_argument("--kv-cache-dtype", default=None, help="auto, int8 or fp8 (docs/quantization.md)")
        parser.add_argument("--quantization", default=None, help="int8, int4 or compressed-tensors (weights)")
        parser.add_argument("--quantization-group-size", type=int, default=None, help="int4 group size")
        parser.add_argument("--cpu-threads", type=int, default=None,
                            help="torch threads of the forward (default: every core)")
        parser.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=False,
                            help="off by default, like the vLLM peer script")
        parser.add_argument("--progress", action="store_true", help="show a progress bar on stderr")
        parser.add_argument("--batch1-prompt-len", type=int, default=128, help="prompt of the lone-request run")
        parser.add_argument("--batch1-tokens", type=int, default=64,
                            help="tokens of the lone-request run (prefill and batch-1 decode tok/s); 0 skips it")

    def run(self, args: argparse.Namespace) -> int:
        from cli.bench.offline.run import run  # import cost (cli.bench.registry)

        engine = engine_options(args, ("num_kv_pages", "kv_cache_memory_fraction", "kv_cache_dtype", "quantization",
                                       "quantization_group_size", "dtype", "cpu_threads"))
        print(json.dumps(run(args.model, args.workload, progress=args.progress,
                             batch1_prompt_len=args.batch1_prompt_len, batch1_tokens=args.batch1_tokens,
                             **engine)))
        return 0
