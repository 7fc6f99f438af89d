"""``flotilla bench ray-overhead``: the in-process engine against the SchedulerActor on Ray (JSON); the runner is ``run``."""

from __future__ import annotations

import argparse
import json

from cli.bench.engine_options import engine_options


class RayOverheadBench:
    name = "ray-overhead"
    help = "in-process engine vs the SchedulerActor on Ray"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--model", default="tiny",
                            help="model folder, .gguf file, hub id, tiny/small, or smollm2-135m")
        parser.add_argument("--workload", required=True, help="JSONL file (make_workload.py format)")
        parser.add_argument("--executor", choices=("local", "ray"), default="local",
                            help="the actor's executor: in-actor (local) or one RayExecutor shard")
        parser.add_argument("--threads", type=int, default=1, help="torch threads on each side")
        parser.add_argument("--runs", type=int, default=5,
                            help="alternating runs of each path (median over pairs)")
        parser.add_argument("--max-num-seqs", type=int, default=64)
        parser.add_argument("--max-model-len", type=int, default=2048)
        parser.add_argument("--num-kv-pages", type=int, default=None)
        parser.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=False,
                            help="off by default, like bench offline")

    def run(self, args: argparse.Namespace) -> int:
        from cli.bench.ray_overhead.run import run  # import cost (cli.bench.registry)

        engine = engine_options(args, ("num_kv_pages",))
        print(json.dumps(run(args.model, args.workload, threads=args.threads, executor=args.executor,
                             runs=args.runs, **engine)))
        return 0
