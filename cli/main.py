"""The ``flotilla`` command line.

  flotilla bench scheduler            Python cost of scheduling (JSON)
  flotilla bench offline --model M --workload W.jsonl
                                      offline throughput on a JSONL workload (JSON)
  flotilla bench ray-overhead --model M --workload W.jsonl
                                      in-process engine vs SchedulerActor on Ray (JSON)
  flotilla bench serve --base-url URL [--config run.yaml]
                                      load generator for any OpenAI-compatible server (JSON, PNG)
  flotilla bench autoscale [--policy flotilla|default]
                                      load profile against an elastic app (JSON, PNG)
  flotilla bench spec --model M --workload W.jsonl --speculative-config JSON
                                      a workload without and with speculative decoding (JSON)
  flotilla bench spec-workloads --out-dir DIR
                                      write the edit / questions chat workloads of bench spec
  flotilla bench accuracy --model M --workload W.jsonl --against JSON [--base JSON]
                                      greedy agreement, KL, KV pages and speed of a config change (JSON)
  flotilla bench structured validity --base-url http://127.0.0.1:PORT/v1
                                      JSON-schema replies and forced tool calls validate? (JSON; exit 1 if not)
  flotilla bench structured overhead --model M
                                      per-step cost of constrained decoding at a mixed batch of 32 (JSON)
  flotilla bench pd --model M [--json]
                                      decode streams + long prompts, colocated vs P/D-disaggregated (JSON)
  flotilla bench lora --model M [--json]
                                      step time with 1, 8, 32 LoRA adapters vs the base; slot cycling (JSON)
  flotilla bench profile --model M [--out P.json]
                                      this machine's step-time model of a model, for simulate (JSON)
  flotilla simulate --trace T (--profile P | --gpu G --model M) [--config C] [--png F]
                                      a fleet in simulated time: real scheduler, router, autoscaler (JSON, PNG)
  flotilla kv drop --app NAME [--address ADDR]
                                      end an app's cluster KV stores and their blocks (JSON)
  flotilla bench moe [--json]
                                      a MoE model against a dense one of the same active parameters, batch 32 (JSON)

Imports: the parser modules are light and imported here; each benchmark's
runner (torch, Ray, the app) is imported when its subcommand runs, so that
``flotilla --help`` and ``flotilla plan`` start at once (import cost;
``cli.bench.registry`` lists the benchmarks).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from cli.bench.registry import BENCHES
from cli.kv import add_kv_parser
from cli.plan.cli import add_plan_parser
from cli.serve import add_serve_parser
from cli.simulate import add_simulate_parser
from scheduling.errors import InvalidParameterError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flotilla", description="Elastic LLM serving on Ray.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_kv_parser(sub)
    add_plan_parser(sub)
    add_serve_parser(sub)
    add_simulate_parser(sub)

    bench = sub.add_parser("bench", help="benchmarks that print JSON")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    for b in BENCHES:
        bench_parser = bench_sub.add_parser(b.name, help=b.help)
        b.add_arguments(bench_parser)
        bench_parser.set_defaults(func=b.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except InvalidParameterError as exc:  # a setting that cannot be honoured: its name and why, no trace
        print(f"flotilla {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
