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
import asyncio
import contextlib
import json
import os
import sys
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

# Replicas share the node's cores: one torch thread each (their CPU reservations are fractional).
ENGINE: dict[str, Any] = {"max_model_len": 2048, "max_num_batched_tokens": 512, "dtype": "float32",
                          "device": "cpu", "cpu_threads": 1}
APP = "flotilla"  # with --url; local runs use one app name per run (see _main)


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


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(url: str, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(OSError, ValueError), urllib.request.urlopen(f"{url}/health", timeout=10) as resp:
            if resp.status == 200:
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} never became healthy")
        time.sleep(0.5)  # polling a server that is starting


def replica_count(app_name: str = APP) -> tuple[int, int] | None:
    """``(running, starting or stopping)`` replicas of the app (None when Serve is not reachable)."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        return None
    try:
        app = serve.status().applications.get(app_name)
        if app is None:
            return None
        states = [(str(state), int(n)) for d in app.deployments.values() for state, n in d.replica_states.items()]
    except Exception:
        return None
    running = sum(n for state, n in states if state.endswith("RUNNING"))
    return running, sum(n for _, n in states) - running


@contextlib.contextmanager
def local_ray(num_cpus: int) -> Iterator[int]:
    """A local Ray cluster and Serve on a free loopback port (yields the port)."""
    import ray
    from ray import serve

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    try:
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield port
    finally:
        serve.shutdown()
        ray.shutdown()


def deploy(app_arguments: dict[str, Any], port: int, name: str = APP) -> str:
    from ray import serve

    from apps.builder import build_app

    serve.run(build_app(app_arguments), name=name, route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url)
    return url


def run_autoscale(args: argparse.Namespace, url: str,
                  app_name: str = APP) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    from cluster.bench_autoscale import default_profile, run_profile, samples_json, summarize

    profile = default_profile(args.peak_rps, idle_s=args.idle_s, ramp_s=args.ramp_s, plateau_s=args.plateau_s,
                              burst_s=args.burst_s, cooldown_s=args.cooldown_s, burst_factor=args.burst_factor)
    load_end = sum(p.duration_s for p in profile[:-1])
    result = asyncio.run(run_profile(
        url, profile, replica_count=lambda: replica_count(app_name), slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms,
        prompt_chars=args.prompt_chars, max_tokens=args.max_tokens,
        settle=lambda n: n is None or n == (args.min_replicas, 0), max_settle_s=args.settle_s))
    summary = summarize(result, slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms,
                        min_replicas=args.min_replicas, load_end_s=load_end)
    return summary, samples_json(result)


def run_router(args: argparse.Namespace, url: str) -> dict[str, Any]:
    from cluster.bench_autoscale_routing import build_workload, run_routing

    workload = build_workload(args.workload, groups=args.groups, per_group=args.per_group,
                              prefix_chars=args.prefix_chars, suffix_chars=args.suffix_chars)
    rate = args.routing_rps if args.routing_rps is not None else (16.0 if args.workload == "prefix" else 0.0)
    return asyncio.run(run_routing(url, workload, concurrency=args.concurrency,
                                   max_tokens=args.routing_max_tokens, rate_rps=rate))


def _main(args: argparse.Namespace) -> int:
    routing = args.mode == "routing"
    choice = args.router if routing else args.policy
    labels = ["flotilla", "default"] if choice == "both" else [choice]
    if routing and choice == "both":
        labels = ["prefix", "default"]
    results: dict[str, Any] = {}
    timelines: dict[str, list[dict[str, Any]]] = {}

    def one(label: str, url: str, app_name: str = APP) -> None:
        if not args.json:
            print(f"flotilla bench autoscale: {args.mode} run '{label}' on {url}", flush=True)
        if routing:
            results[label] = run_router(args, url)
            return
        summary, samples = run_autoscale(args, url, app_name)
        results[label] = {**summary, **({"samples": samples} if args.samples else {})}
        timelines[f"policy: {label}"] = samples

    # With --json, stdout carries the JSON alone: what Ray prints meanwhile (its teardown
    # messages included) goes to stderr.
    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
        if args.url:
            one(labels[0], args.url.rstrip("/"))
        else:
            from ray import serve

            with local_ray(args.num_cpus) as port:
                for label in labels:
                    if routing:
                        extra: dict[str, Any] = {"num_replicas": args.replicas, "request_router": label}
                    else:
                        extra = {"autoscaling": autoscaling_args(args, label)}
                    # A fresh app name per run: the proxy keeps one handle (and so one request
                    # router) per deployment id, even across delete and redeploy.
                    name = f"{APP}-{args.mode}-{label}"
                    one(label, deploy(app_args(args, **extra), port, name), name)
                    serve.delete(name)
    out: dict[str, Any] = {"mode": args.mode, "runs": results}
    if timelines and args.png:
        from cluster.bench_autoscale_plot import plot_timeline

        out["png"] = str(plot_timeline(timelines, args.png, slo_ttft_ms=args.slo_ttft_ms,
                                       slo_tpot_ms=args.slo_tpot_ms))
    print(json.dumps(out, indent=None if args.json else 2))
    return 0
