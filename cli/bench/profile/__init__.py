"""``flotilla bench profile``: the command line.

    flotilla bench profile --model tiny --out profiles/tiny_cpu.json

Times engine steps of known shapes on this machine and fits the linear
step-time model ``flotilla simulate`` and ``flotilla plan`` read (``run``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


class ProfileBench:
    name = "profile"
    help = "this machine's step-time model of a model (prefill by tokens, decode by batch and context), for simulate"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--model", default="tiny",
                            help="model folder, .gguf file, hub id, tiny/small, or smollm2-135m")
        parser.add_argument("--runs", type=int, default=3, help="passes over every shape (medians)")
        parser.add_argument("--steps", type=int, default=8, help="decode steps timed per decode shape and pass")
        parser.add_argument("--seed", type=int, default=0, help="of the prompts")
        parser.add_argument("--dtype", default=None)
        parser.add_argument("--cpu-threads", type=int, default=None,
                            help="torch threads of the forward (default: every core)")
        parser.add_argument("--num-kv-pages", type=int, default=None,
                            help="the replica's KV pool the profile records (default: the engine's)")
        parser.add_argument("--out", default=None, help="also write the profile JSON here (simulate --profile)")
        parser.add_argument("--progress", action="store_true", help="show a progress bar on stderr")
        parser.add_argument("--json", action="store_true", help="accepted for symmetry: the output is one JSON object")

    def run(self, args: argparse.Namespace) -> int:
        from cli.bench.profile.run import run  # import cost (cli.bench.registry)

        engine = {k: v for k, v in (("dtype", args.dtype), ("cpu_threads", args.cpu_threads),
                                    ("num_kv_pages", args.num_kv_pages)) if v is not None}
        out = run(args.model, runs=args.runs, steps=args.steps, seed=args.seed, progress=args.progress, **engine)
        if args.out:
            path = Path(args.out)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(out["profile"], indent=1) + "\n")
        print(json.dumps(out))
        return 0
