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

Imports: the parser modules are light and imported here; each benchmark's
runner (torch, Ray, the app) is imported when its subcommand runs, so that
``flotilla --help`` and ``flotilla plan`` start at once (import cost).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from cli.bench.accuracy_cli import add_bench_accuracy_parser
from cli.bench.autoscale_cli import add_bench_autoscale_parser
from cli.bench.pd_cli import add_bench_pd_parser
from cli.bench.serve_cli import add_bench_serve_parser
from cli.bench.spec_cli import add_bench_spec_parsers
from cli.bench.structured_cli import add_bench_structured_parser
from cli.plan.cli import add_plan_parser
from cli.serve import add_serve_parser
from scheduling.errors import InvalidParameterError


def _bench_scheduler(args: argparse.Namespace) -> int:
    from cli.bench.scheduler import run  # import cost (module docstring)

    sizes = tuple(int(x) for x in args.sizes.split(","))
    print(json.dumps(run(sizes=sizes, num_steps=args.steps), indent=2))
    return 0


def _bench_offline(args: argparse.Namespace) -> int:
    from cli.bench.offline import run  # import cost (module docstring)

    engine = {
        "max_num_seqs": args.max_num_seqs,
        "max_model_len": args.max_model_len,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "enable_prefix_caching": args.prefix_caching,
    }
    if args.num_kv_pages is not None:
        engine["num_kv_pages"] = args.num_kv_pages
    if args.kv_cache_memory_fraction is not None:
        engine["kv_cache_memory_fraction"] = args.kv_cache_memory_fraction
    for name in ("kv_cache_dtype", "quantization", "quantization_group_size"):
        if getattr(args, name) is not None:
            engine[name] = getattr(args, name)
    if args.dtype is not None:
        engine["dtype"] = args.dtype
    if args.cpu_threads is not None:
        engine["cpu_threads"] = args.cpu_threads
    print(json.dumps(run(args.model, args.workload, progress=args.progress,
                         batch1_prompt_len=args.batch1_prompt_len, batch1_tokens=args.batch1_tokens, **engine)))
    return 0


def _bench_ray_overhead(args: argparse.Namespace) -> int:
    from cli.bench.ray_overhead import run  # import cost (module docstring)

    engine: dict[str, object] = {
        "max_num_seqs": args.max_num_seqs,
        "max_model_len": args.max_model_len,
        "enable_prefix_caching": args.prefix_caching,
    }
    if args.num_kv_pages is not None:
        engine["num_kv_pages"] = args.num_kv_pages
    result = run(args.model, args.workload, threads=args.threads, executor=args.executor,
                 runs=args.runs, **engine)
    print(json.dumps(result))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flotilla", description="Elastic LLM serving on Ray.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_plan_parser(sub)
    add_serve_parser(sub)

    bench = sub.add_parser("bench", help="benchmarks that print JSON")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    add_bench_serve_parser(bench_sub)
    add_bench_autoscale_parser(bench_sub)
    add_bench_spec_parsers(bench_sub)
    add_bench_accuracy_parser(bench_sub)
    add_bench_structured_parser(bench_sub)
    add_bench_pd_parser(bench_sub)
    sched = bench_sub.add_parser("scheduler", help="schedule()+update() and match_prefix cost")
    sched.add_argument("--sizes", default="64,256,1024", help="running decodes to measure, comma-separated")
    sched.add_argument("--steps", type=int, default=200, help="timed steps per size")
    sched.set_defaults(func=_bench_scheduler)

    off = bench_sub.add_parser("offline", help="offline throughput on a JSONL workload")
    off.add_argument("--model", default="tiny", help="model folder, .gguf file, hub id, tiny/small, or smollm2-135m")
    off.add_argument("--workload", required=True, help="JSONL file (make_workload.py format)")
    off.add_argument("--max-num-seqs", type=int, default=64)
    off.add_argument("--max-model-len", type=int, default=2048)
    off.add_argument("--max-num-batched-tokens", type=int, default=2048)
    off.add_argument("--num-kv-pages", type=int, default=None)
    off.add_argument("--kv-cache-memory-fraction", type=float, default=None)
    off.add_argument("--dtype", default=None)
    off.add_argument("--kv-cache-dtype", default=None, help="auto, int8 or fp8 (docs/quantization.md)")
    off.add_argument("--quantization", default=None, help="int8, int4 or compressed-tensors (weights)")
    off.add_argument("--quantization-group-size", type=int, default=None, help="int4 group size")
    off.add_argument("--cpu-threads", type=int, default=None, help="torch threads of the forward (default: every core)")
    off.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=False,
                     help="off by default, like the vLLM peer script")
    off.add_argument("--progress", action="store_true", help="show a progress bar on stderr")
    off.add_argument("--batch1-prompt-len", type=int, default=128, help="prompt of the lone-request run")
    off.add_argument("--batch1-tokens", type=int, default=64,
                     help="tokens of the lone-request run (prefill and batch-1 decode tok/s); 0 skips it")
    off.set_defaults(func=_bench_offline)

    rov = bench_sub.add_parser("ray-overhead", help="in-process engine vs the SchedulerActor on Ray")
    rov.add_argument("--model", default="tiny", help="model folder, .gguf file, hub id, tiny/small, or smollm2-135m")
    rov.add_argument("--workload", required=True, help="JSONL file (make_workload.py format)")
    rov.add_argument("--executor", choices=("local", "ray"), default="local",
                     help="the actor's executor: in-actor (local) or one RayExecutor shard")
    rov.add_argument("--threads", type=int, default=1, help="torch threads on each side")
    rov.add_argument("--runs", type=int, default=5, help="alternating runs of each path (median over pairs)")
    rov.add_argument("--max-num-seqs", type=int, default=64)
    rov.add_argument("--max-model-len", type=int, default=2048)
    rov.add_argument("--num-kv-pages", type=int, default=None)
    rov.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=False,
                     help="off by default, like bench offline")
    rov.set_defaults(func=_bench_ray_overhead)
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
