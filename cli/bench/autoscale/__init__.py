"""``flotilla bench autoscale``: elasticity and routing benchmarks (JSON, and a PNG timeline).

    flotilla bench autoscale                          # our policy, local tiny app, default profile
    flotilla bench autoscale --policy both --png docs/img/autoscale_timeline.png
    flotilla bench autoscale --mode routing --router both          # prefix vs default router
    flotilla bench autoscale --mode routing --router both --workload unique
    flotilla bench autoscale --url http://127.0.0.1:8000 --json   # against a running app

Without ``--url`` it starts a local Ray cluster and deploys the app itself
(each replica small: fractional CPUs and a few sequences, so replica capacity,
not the machine, runs out first), runs, and tears everything down. The run is
``run``; the load profile and its summary ``profile``, the router comparison
``routing``, the timeline ``plot``.
"""

from __future__ import annotations

import argparse

from cli.bench.engine_options import SHARED_ACTOR_CPUS


class AutoscaleBench:
    name = "autoscale"
    help = "load profile vs autoscaling policy, or router comparison"

    def add_arguments(self, sp: argparse.ArgumentParser) -> None:
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
        a.add_argument("--trace-out", default=None,
                       help="write the requests sent as a JSONL trace for `flotilla simulate --trace`")
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
        e.add_argument("--replica-num-cpus", type=float, default=SHARED_ACTOR_CPUS)
        e.add_argument("--scheduler-num-cpus", type=float, default=SHARED_ACTOR_CPUS)

    def run(self, args: argparse.Namespace) -> int:
        from cli.bench.autoscale.run import main  # import cost (cli.bench.registry)

        return main(args)
