"""``flotilla bench scheduler``: the Python cost of scheduling (JSON); the runner is ``run``."""

from __future__ import annotations

import argparse
import json


class SchedulerBench:
    name = "scheduler"
    help = "schedule()+update() and match_prefix cost"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--sizes", default="64,256,1024", help="running decodes to measure, comma-separated")
        parser.add_argument("--steps", type=int, default=200, help="timed steps per size")

    def run(self, args: argparse.Namespace) -> int:
        from cli.bench.scheduler.run import run  # import cost (cli.bench.registry)

        sizes = tuple(int(x) for x in args.sizes.split(","))
        print(json.dumps(run(sizes=sizes, num_steps=args.steps), indent=2))
        return 0
