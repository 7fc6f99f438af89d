"""``flotilla bench autoscale``, the run: a local Ray cluster and app (or ``--url``), the load, the JSON.

The local cluster and the deploy-and-wait are ``cli.bench.harness``'s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from pathlib import Path
from typing import Any

import ray
from ray import serve

from cli.bench.autoscale.plot import plot_timeline
from cli.bench.autoscale.profile import default_profile, run_profile, samples_json, summarize
from cli.bench.autoscale.routing import build_workload, run_routing
from cli.bench.harness import deploy, local_ray
from cli.simulate.trace import Arrival, write_jsonl

# Replicas share the node's cores: one torch thread each (their CPU reservations are fractional).
ENGINE: dict[str, Any] = {"max_model_len": 2048, "max_num_batched_tokens": 512, "dtype": "float32",
                          "device": "cpu", "cpu_threads": 1}
APP = "flotilla"  # with --url; local runs use one app name per run (see main)


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


def replica_count(app_name: str = APP) -> tuple[int, int] | None:
    """``(running, starting or stopping)`` replicas of the app (None when Serve is not reachable)."""
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


def run_autoscale(args: argparse.Namespace, url: str,
                  app_name: str = APP) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    profile = default_profile(args.peak_rps, idle_s=args.idle_s, ramp_s=args.ramp_s, plateau_s=args.plateau_s,
                              burst_s=args.burst_s, cooldown_s=args.cooldown_s, burst_factor=args.burst_factor)
    load_end = sum(p.duration_s for p in profile[:-1])
    result = asyncio.run(run_profile(
        url, profile, replica_count=lambda: replica_count(app_name), slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms,
        prompt_chars=args.prompt_chars, max_tokens=args.max_tokens,
        settle=lambda n: n is None or n == (args.min_replicas, 0), max_settle_s=args.settle_s))
    summary = summarize(result, slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms,
                        min_replicas=args.min_replicas, load_end_s=load_end)
    if args.trace_out:  # what was sent, as `flotilla simulate --trace` reads it (prompt tokens from usage)
        write_jsonl([Arrival(r.sent, r.prompt_tokens, args.max_tokens) for r in result.records if r.prompt_tokens],
                    Path(args.trace_out))
    return summary, samples_json(result)


def run_router(args: argparse.Namespace, url: str) -> dict[str, Any]:
    workload = build_workload(args.workload, groups=args.groups, per_group=args.per_group,
                              prefix_chars=args.prefix_chars, suffix_chars=args.suffix_chars)
    rate = args.routing_rps if args.routing_rps is not None else (16.0 if args.workload == "prefix" else 0.0)
    return asyncio.run(run_routing(url, workload, concurrency=args.concurrency,
                                   max_tokens=args.routing_max_tokens, rate_rps=rate))


def main(args: argparse.Namespace) -> int:
    """Run ``bench autoscale`` as ``args`` say; prints the JSON."""
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
        out["png"] = str(plot_timeline(timelines, args.png, slo_ttft_ms=args.slo_ttft_ms,
                                       slo_tpot_ms=args.slo_tpot_ms))
    print(json.dumps(out, indent=None if args.json else 2))
    return 0
