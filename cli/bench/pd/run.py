"""``flotilla bench pd``, the run: a private Ray cluster, the two apps in turn, the workload, the JSON.

The local cluster and the deploy-and-wait are ``cli.bench.harness``'s: one
way to start a benchmark's own app.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from pathlib import Path
from typing import Any

import aiohttp
from ray import serve

from actors.config import EngineConfig
from actors.remote.cpu_threads import usable_cores
from cli.bench.harness import deploy, serve_on
from cli.bench.metrics import fetch
from cli.bench.pd.bandwidth import Bandwidth, measure_bandwidth
from cli.bench.pd.figures import PDFigures, parse_pd_figures
from cli.bench.pd.report import mode_report, parse_pd_slo, transfer_report
from cli.bench.pd.workload import PDWorkload, WorkloadResult, run_workload, send
from cli.bench.stats import ratio
from cli.bench.stream_client import resolve_model
from cli.simulate.trace import Arrival, write_jsonl
from scheduling.errors import InvalidParameterError

MODES = ("colocated", "disaggregated")


def workload(args: argparse.Namespace) -> PDWorkload:
    return PDWorkload(streams=args.streams, short_tokens=args.short_tokens, output_tokens=tuple(args.output_tokens),
                      long_tokens=args.long_tokens, long_max_tokens=args.long_max_tokens,
                      long_every_s=args.long_every_s, duration_s=args.duration_s, vocab=args.vocab, seed=args.seed)


def check_settings(args: argparse.Namespace, plan: PDWorkload, cores: int) -> None:
    """Refuse settings under which the comparison would not be the one described (typed, naming the flag)."""
    if cores < 2:
        raise InvalidParameterError("cores", f"the disaggregated app needs a core per replica, got {cores}")
    if not plan.short_tokens < args.remote_prefill_min_tokens <= plan.long_tokens:
        raise InvalidParameterError(
            "remote_prefill_min_tokens", f"must lie in ({plan.short_tokens}, {plan.long_tokens}] (short-tokens, "
                                         f"long-tokens) so that long prompts, and only they, prefill remotely; "
                                         f"got {args.remote_prefill_min_tokens}")
    if plan.long_tokens + plan.long_max_tokens > args.max_model_len:
        raise InvalidParameterError("max_model_len", f"{args.max_model_len} < long-tokens + long-max-tokens "
                                                     f"({plan.long_tokens + plan.long_max_tokens})")
    need = plan.long_tokens + plan.long_max_tokens + plan.streams * (plan.short_tokens + plan.output_tokens[1])
    if args.num_kv_pages * EngineConfig.page_size < need:
        raise InvalidParameterError("num_kv_pages", f"{args.num_kv_pages} pages of {EngineConfig.page_size} "
                                                    f"tokens hold less than a long prompt and every stream ({need})")


def app_args(args: argparse.Namespace, mode: str, cores: int) -> dict[str, Any]:
    """``build_app`` arguments of one mode: one replica on every core, or a prefill and a decode replica."""
    common: dict[str, Any] = {"model": args.model, "max_model_len": args.max_model_len,
                              "num_kv_pages": args.num_kv_pages, "max_num_seqs": args.max_num_seqs,
                              "max_num_batched_tokens": args.max_num_batched_tokens}
    if args.device is not None:
        common["device"] = args.device
    if mode == "colocated":
        return {**common, "num_replicas": 1, "cpu_threads": cores}
    prefill = cores // 2
    return {**common, "pd": {"remote_prefill_min_tokens": args.remote_prefill_min_tokens,
                             "prefill": {"num_replicas": 1, "cpu_threads": prefill},
                             "decode": {"num_replicas": 1, "cpu_threads": cores - prefill}}}


async def scrape_pd(session: aiohttp.ClientSession, url: str) -> PDFigures:
    """The decode replica's P/D figures (its ``/metrics``; with one decode replica, every scrape reaches it)."""
    return parse_pd_figures(await fetch(session, url))


async def measure(url: str, plan: PDWorkload, timeout_s: float, mode: str) -> tuple[WorkloadResult, PDFigures]:
    """Warm up, then run ``plan`` against ``url``; returns the clients' view and the P/D figures' change."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        model = await resolve_model(session, url)
        for req in plan.warmup_requests():  # untimed: first-call costs stay out of the figures
            warm = await send(session, url, model, req)
            if not warm.ok:
                raise RuntimeError(f"bench pd ({mode}): the warm-up request failed: {warm.error}")
        before = await scrape_pd(session, url)
        result = await run_workload(session, url, model, plan)
        after = await scrape_pd(session, url)
    return result, after.minus(before)


def run_mode(args: argparse.Namespace, mode: str, cores: int, port: int,
             plan: PDWorkload) -> tuple[WorkloadResult, PDFigures]:
    """Deploy ``mode``'s app, run the workload on it, delete the app."""
    # A fresh app name per mode: the proxy keeps one handle (and router) per deployment id.
    name = f"bench-pd-{mode}"
    url = deploy(app_args(args, mode, cores), port, name)
    try:
        return asyncio.run(measure(url, plan, args.timeout_s, mode))
    finally:
        serve.delete(name)


def main(args: argparse.Namespace, serve_port: int | None = None) -> int:
    """Run ``bench pd`` as ``args`` say; prints the JSON. ``serve_port``: Serve of the cluster this process
    already runs (``harness.serve_on``); None starts a private one."""
    plan = workload(args)
    slo = parse_pd_slo(args.slo)
    cores = args.cores if args.cores is not None else usable_cores()
    check_settings(args, plan, cores)
    runs: dict[str, tuple[WorkloadResult, PDFigures]] = {}
    bandwidth: Bandwidth | None = None
    # With --json, stdout carries the JSON alone: what Ray prints meanwhile goes to stderr.
    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext(), \
            serve_on(args.num_cpus, serve_port) as port:
        for mode in MODES:
            print(f"flotilla bench pd: {mode} run ({plan.duration_s:g} s)", file=sys.stderr, flush=True)
            runs[mode] = run_mode(args, mode, cores, port, plan)
        moved = runs["disaggregated"][1]
        if moved.remote_prefills > 0:  # else there is no payload size to time (the report shows 0 prefills)
            per_prompt = int(moved.kv_bytes / moved.remote_prefills)
            bandwidth = measure_bandwidth(per_prompt, args.bandwidth_runs)
    if args.trace_out:  # what each mode sent, as `flotilla simulate --trace` reads it (tokens from usage)
        for mode, (result, _) in runs.items():
            sent = sorted((r for r in [*result.short, *result.long] if r.ok), key=lambda r: r.start_s)
            write_jsonl([Arrival(r.start_s, r.prompt_tokens, r.output_tokens) for r in sent],
                        Path(f"{args.trace_out}_{mode}.jsonl"))
    colocated = mode_report(runs["colocated"][0], slo)
    disaggregated = {**mode_report(runs["disaggregated"][0], slo),
                     **transfer_report(runs["disaggregated"][1], plan.long_tokens, bandwidth)}
    out: dict[str, Any] = {
        "benchmark": "pd", "model": args.model, "cores": cores,
        "config": {**{k: getattr(plan, k) for k in plan.__dataclass_fields__}, "slo_ms": slo,
                   "remote_prefill_min_tokens": args.remote_prefill_min_tokens,
                   "colocated_cpu_threads": cores, "prefill_cpu_threads": cores // 2,
                   "decode_cpu_threads": cores - cores // 2, "max_model_len": args.max_model_len,
                   "num_kv_pages": args.num_kv_pages, "max_num_seqs": args.max_num_seqs,
                   "max_num_batched_tokens": args.max_num_batched_tokens},
        "colocated": colocated,
        "disaggregated": disaggregated,
        "tpot_p95_ratio": ratio(disaggregated["tpot_p95_ms"], colocated["tpot_p95_ms"]),
        "goodput_ratio": ratio(disaggregated["goodput"], colocated["goodput"]),
        "kv_transfer_p50_over_expected": ratio(disaggregated["kv_transfer_ms_p50"],
                                               disaggregated["expected_transfer_ms"]),
    }
    print(json.dumps(out, indent=None if args.json else 2))
    return 0
