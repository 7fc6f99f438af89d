"""``flotilla bench autoscale``: elasticity and routing benchmarks (JSON, and a PNG timeline).

    flotilla bench autoscale                          # our policy, local tiny app, default profile
    flotilla bench autoscale --policy both --png docs/img/autoscale_timeline.png
    flotilla bench autoscale --mode routing --router both          # prefix vs default router
    flotilla bench autoscale --mode routing --router both --workload unique
    flotilla bench autoscale --url http://127.0.0.1:8000 --json   # against a running app

Without ``--url`` it starts a local Ray cluster and deploys the app itself
(each replica small: fractional CPUs and a few sequences, so replica capacity,
not the machine, runs out first), runs, and tears everything down.
"""

from __future__ import annotations

import argparse
from typing import Any

# Replicas share the node's cores: one torch thread each (their CPU reservations are fractional).
ENGINE: dict[str, Any] = {"max_model_len": 2048, "max_num_batched_tokens": 512, "dtype": "float32",
                          "device": "cpu", "cpu_threads": 1}
APP = "flotilla"  # with --url; local runs use one app name per run (see autoscale_run.main)


def add_bench_autoscale_parser(bench_subparsers: Any) -> argparse.ArgumentParser:
    """Register ``bench autoscale`` on the ``bench`` subparsers."""
    sp = bench_subparsers.add_parser("autoscale", help="load profile vs autoscaling policy, or router comparison")
    sp.add_argument("--mode", choices=("autoscale", "routing"), default="autoscale")
    sp.add_argument("--url", default=None, help="a running app (default: start a local one)")
    sp.add_argument("--model", default="tiny")
    sp.add_argument("--json", action="store_true", help="print only the JSON")
    sp.add_argument("--samples", action="store_true", help="include the per-second samples in the JSON")
    sp.add_argument("--png", default="bench_autoscale.png", help="timeline plot ('' for none)")
    a = sp.add_argument_group("autoscale mode")
    a.add_argument("--policy", choices=("flotilla", "default", "both"), default="flotilla")
    a.add_argument("--min-replicas", type=int, default=1)
    a.add_argument("--max-replicas", type=int, default=4)
    a.add_argument("--slo-ttft-ms", type=float, default=1500.0)
    a.add_argument("--slo-tpot-ms", type=float, default=250.0)
    a.add_argument("--target-queue-per-replica", type=float, default=2.0)
    a.add_argument("--target-ongoing-requests", type=float, default=2.0, help="the default policy's target")
    a.add_argument("--upscale-delay-s", type=float, default=3.0)
    a.add_argument("--downscale-delay-s", type=float, default=15.0)
    a.add_argument("--peak-rps", type=float, default=6.0)
    a.add_argument("--idle-s", type=float, default=5.0)
    a.add_argument("--ramp-s", type=float, default=20.0)
    a.add_argument("--plateau-s", type=float, default=40.0)
    a.add_argument("--burst-s", type=float, default=10.0)
    a.add_argument("--burst-factor", type=float, default=1.5)
    a.add_argument("--cooldown-s", type=float, default=30.0)
    a.add_argument("--settle-s", type=float, default=90.0, help="extra seconds to wait for the minimum")
    a.add_argument("--prompt-chars", type=int, default=64)
    a.add_argument("--max-tokens", type=int, default=128)
    r = sp.add_argument_group("routing mode")
    r.add_argument("--router", choices=("prefix", "default", "both"), default="both")
    r.add_argument("--workload", choices=("prefix", "unique"), default="prefix")
    r.add_argument("--replicas", type=int, default=3)
    r.add_argument("--groups", type=int, default=8)
    r.add_argument("--per-group", type=int, default=64)
    r.add_argument("--prefix-chars", type=int, default=512)
    r.add_argument("--suffix-chars", type=int, default=32)
    r.add_argument("--concurrency", type=int, default=12, help="closed loop (workload unique)")
    r.add_argument("--routing-rps", type=float, default=None,
                   help="open-loop rate (default: 16 for workload prefix; 0 = closed loop)")
    r.add_argument("--routing-max-tokens", type=int, default=8)
    e = sp.add_argument_group("local app")
    e.add_argument("--num-cpus", type=int, default=4, help="CPUs of the local Ray cluster")
    e.add_argument("--max-num-seqs", type=int, default=2)
    e.add_argument("--num-kv-pages", type=int, default=None,
                   help="KV pages per replica (default: 256 autoscale; 160 routing: a third of "
                        "the prefixes and the running requests fit, not all of them)")
    e.add_argument("--replica-num-cpus", type=float, default=0.1)
    e.add_argument("--scheduler-num-cpus", type=float, default=0.1)
    sp.set_defaults(func=_main)
    return sp


def app_args(args: argparse.Namespace, **extra: Any) -> dict[str, Any]:
    """``build_app`` arguments of the local app (small replicas)."""
    pages = args.num_kv_pages or (160 if args.mode == "routing" else 256)
    return {"model": args.model, "served_model_name": "tiny", **ENGINE, "max_num_seqs": args.max_num_seqs,
            "num_kv_pages": pages, "replica_options": {"num_cpus": args.replica_num_cpus},
            "scheduler_options": {"num_cpus": args.scheduler_num_cpus}, **extra}


def autoscaling_args(args: argparse.Namespace, policy: str) -> dict[str, Any]:
    common = {"policy": policy, "min_replicas": args.min_replicas, "max_replicas": args.max_replicas,
              "upscale_delay_s": args.upscale_delay_s, "downscale_delay_s": args.downscale_delay_s}
    if policy == "default":
        return {**common, "target_ongoing_requests": args.target_ongoing_requests}
    return {**common, "slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms,
            "target_queue_per_replica": args.target_queue_per_replica}


def _main(args: argparse.Namespace) -> int:
    # Import cost: Ray, Serve and the app load only when the benchmark runs, so that
    # `flotilla --help` (which registers this parser) stays fast.
    from cli.bench.autoscale_run import main

    return main(args)
