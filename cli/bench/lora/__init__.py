"""``flotilla bench lora``: the command line.

    flotilla bench lora --model smollm2-135m --json

Step time at batch 32 on the base model and with 1, 8 and 32 distinct
adapters, and throughput while requests cycle through more adapters than
``max_loras`` (docs/lora.md). The run is ``run``; the seeded random
adapters it serves ``adapters``.

    flotilla bench lora --served --json

Instead: adapters chosen by ``model`` through ``flotilla serve`` with two
replicas, under flotilla's router and Serve's default, and each one's hit
rate of resident adapters (``served``).
"""

from __future__ import annotations

import argparse
import json

from cli.bench.engine_options import engine_options
from cli.bench.lora.batch import BATCH_SIZE


class LoRABench:
    name = "lora"
    help = "LoRA step overhead at batch 32 (1, 8, 32 adapters) and throughput cycling adapters through slots"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--model", default="tiny",
                            help="model folder, .gguf file, hub id, tiny/small, or smollm2-135m")
        parser.add_argument("--rank", type=int, default=16, help="rank of every adapter (and max_lora_rank)")
        parser.add_argument("--runs", type=int, default=3, help="runs through every configuration (medians)")
        parser.add_argument("--steps", type=int, default=16, help="decode steps timed per configuration and run")
        parser.add_argument("--context", type=int, default=128, help="prompt tokens of each request of the batch")
        parser.add_argument("--seed", type=int, default=0, help="of the prompts and the adapters' weights")
        parser.add_argument("--max-model-len", type=int, default=512,
                            help="small by default: the CPU KV pool holds twice max_num_seqs full sequences")
        parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
        parser.add_argument("--num-kv-pages", type=int, default=None)
        parser.add_argument("--kv-cache-memory-fraction", type=float, default=None)
        parser.add_argument("--dtype", default=None)
        parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None,
                            help="default: the engine's (auto)")
        parser.add_argument("--cpu-threads", type=int, default=None,
                            help="torch threads of the forward (default: every core)")
        parser.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=False,
                            help="off by default, like bench offline (passes repeat the same prompts)")
        # The batch is the engine's whole admission: exactly BATCH_SIZE sequences, not a flag.
        parser.set_defaults(max_num_seqs=BATCH_SIZE)
        cy = parser.add_argument_group("cycling (more adapters than slots)")
        cy.add_argument("--cycle-max-loras", type=int, default=4, help="adapter slots of the cycling engine")
        cy.add_argument("--cycle-max-cpu-loras", type=int, default=None,
                        help="adapters kept read on the host (default: the engine's, max_loras)")
        cy.add_argument("--cycle-adapters", type=int, default=16, help="adapters the requests cycle through")
        cy.add_argument("--cycle-requests", type=int, default=64, help="requests, request i on adapter i %% adapters")
        cy.add_argument("--cycle-prompt-len", type=int, default=16, help="prompt tokens of each request")
        cy.add_argument("--cycle-max-tokens", type=int, default=16, help="output tokens of each request")
        cy.add_argument("--cycle-runs", type=int, default=3, help="alternating base/LoRA runs (medians)")
        sv = parser.add_argument_group("served (--served: through flotilla serve, instead of the two above)")
        sv.add_argument("--served", action="store_true",
                        help="adapters chosen by model through `flotilla serve` with several replicas, and each "
                             "router's hit rate of resident adapters (cli/bench/lora/served.py)")
        sv.add_argument("--served-replicas", type=int, default=2)
        sv.add_argument("--served-adapters", type=int, default=8, help="adapters registered with --lora-modules")
        sv.add_argument("--served-requests", type=int, default=64, help="request i names adapter i mod adapters")
        sv.add_argument("--served-concurrency", type=int, default=8, help="requests in flight")
        sv.add_argument("--served-max-tokens", type=int, default=8)
        sv.add_argument("--served-max-loras", type=int, default=4, help="each replica's adapter slots")
        sv.add_argument("--served-router", choices=("prefix", "default", "both"), default="both")
        sv.add_argument("--served-start-timeout-s", type=float, default=300.0)
        parser.add_argument("--progress", action="store_true", help="show progress bars on stderr")
        parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")

    def run(self, args: argparse.Namespace) -> int:
        if args.served:
            return self._served(args)
        # Here, not at the top: import cost (cli.bench.registry).
        from cli.bench.lora.run import CycleSettings, format_table, run

        engine = engine_options(args, ("num_kv_pages", "kv_cache_memory_fraction", "dtype", "device", "cpu_threads"))
        cycle = CycleSettings(max_loras=args.cycle_max_loras, max_cpu_loras=args.cycle_max_cpu_loras,
                              adapters=args.cycle_adapters, requests=args.cycle_requests,
                              prompt_len=args.cycle_prompt_len, max_tokens=args.cycle_max_tokens,
                              runs=args.cycle_runs)
        result = run(args.model, rank=args.rank, runs=args.runs, steps=args.steps, context=args.context,
                     seed=args.seed, cycle=cycle, progress=args.progress, **engine)
        print(json.dumps(result) if args.json else format_table(result))
        return 0

    @staticmethod
    def _served(args: argparse.Namespace) -> int:
        # Here, not at the top: import cost (cli.bench.registry); openai is the bench extra's.
        from cli.bench.lora.served import ServedSettings, run_served

        settings = ServedSettings(
            model=args.model, replicas=args.served_replicas, adapters=args.served_adapters,
            requests=args.served_requests, concurrency=args.served_concurrency, max_tokens=args.served_max_tokens,
            rank=args.rank, max_loras=args.served_max_loras, router=args.served_router, seed=args.seed,
            cpu_threads=args.cpu_threads or 1, start_timeout_s=args.served_start_timeout_s)  # fmt: skip
        print(json.dumps(run_served(settings), indent=None if args.json else 2))
        return 0
