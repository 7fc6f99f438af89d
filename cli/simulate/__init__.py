"""``flotilla simulate``: the command line of the fleet simulator (``fleet``; docs/fleet.md).

    flotilla simulate --trace diurnal:peak=200,minutes=10 --gpu H200 --model llama-3-8b --max-replicas 64 --json

Light on purpose: the simulator (the scheduler, the router, the policy) is
imported when the command runs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def add_simulate_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``simulate`` on ``subparsers`` (from ``add_subparsers``)."""
    p = subparsers.add_parser(
        "simulate", help="discrete-event simulation of a fleet: the real scheduler, router and autoscaler",
        description="Play a trace of arrivals through simulated replicas that run flotilla's own scheduler "
        "(step times from a profile), its router and its autoscaling policy, in simulated time.")
    p.add_argument("--trace", required=True,
                   help="a JSONL of {t, prompt_tokens, output_tokens} lines, or a generator: "
                        "poisson:rate=R,minutes=M | bursty:rate=R,burst=B,period_s=P,minutes=M | "
                        "diurnal:peak=R,minutes=M (each with prompt_tokens=, output_tokens=, spread=, seed=)")
    p.add_argument("--profile", default=None, help="a step profile JSON (flotilla bench profile)")
    p.add_argument("--gpu", default=None, help="with --model: a roofline profile of this GPU preset")
    p.add_argument("--model", default=None, help="with --gpu: a model preset of flotilla plan")
    p.add_argument("--tp", type=int, default=1, help="GPUs per replica of a roofline profile")
    p.add_argument("--config", default=None, help="YAML/JSON: policy, startup_s, tick_s, target_ongoing_requests, "
                                                   "initial_replicas, autoscaling: {AutoscalingConfig fields}")
    p.add_argument("--policy", choices=("flotilla", "default"), default=None,
                   help="flotilla: the queue + SLO policy; default: Ray Serve's ongoing-requests rule")
    p.add_argument("--min-replicas", type=int, default=None)
    p.add_argument("--max-replicas", type=int, default=None)
    p.add_argument("--startup-s", type=float, default=None, help="seconds from a scale-up to a ready replica")
    p.add_argument("--slo", nargs="+", default=None, metavar="METRIC:MS",
                   help="goodput SLOs, e.g. ttft:2000 tpot:100 (default: the autoscaling targets)")
    p.add_argument("--png", default=None, help="write the timeline here")
    p.add_argument("--seed", type=int, default=0, help="of the router's random choices")
    p.add_argument("--json", action="store_true", help="accepted for symmetry: the output is one JSON object")
    p.set_defaults(func=run_simulate)
    return p


def run_simulate(args: argparse.Namespace) -> int:
    from cli.simulate.run import (  # import cost (module docstring)
        build_profile,
        read_config,
        simulate,
    )

    profile = build_profile(args.profile, args.gpu, args.model, args.tp)
    config = read_config(Path(args.config) if args.config else None,
                         {"policy": args.policy, "startup_s": args.startup_s, "min_replicas": args.min_replicas,
                          "max_replicas": args.max_replicas})
    out = simulate(args.trace, profile, config, slo=args.slo, png=Path(args.png) if args.png else None,
                   seed=args.seed)
    print(json.dumps(out))
    return 0
