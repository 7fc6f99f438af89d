"""``flotilla bench serve``: load an OpenAI-compatible server and measure what clients see.

Works against any server with ``/v1/completions`` and ``/v1/chat/completions``
streaming SSE (flotilla, vLLM, ...). Every request streams with
``stream_options.include_usage`` so token counts come from the server's own
``usage``; requests go through ``cli.bench.stream_client`` (the benchmarks'
one client), which defines TTFT, ITL and TPOT.

When the server is flotilla, its ``/metrics`` is scraped before, during and
after each run for the engine's peak memory, memory limit and utilisation
(one replica per scrape: with several replicas, read Ray's Prometheus
endpoint instead); for other servers these figures are null. With
``cpu_breakdown`` (the server on this host), each run also reports the CPU
each process of the serving path used (``cli.bench.serve.cpu_breakdown``).

``main`` runs the command: the settings (``config``), the run or ``--load``,
then ``--out``, ``--plot`` and ``--compare`` (a regression table on stderr,
exit 1 when TPOT P95 or throughput regressed beyond ``--threshold``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import aiohttp

from cli.bench.serve.arrivals import arrival_offsets
from cli.bench.serve.compare import compare, format_table
from cli.bench.serve.config import ServeBenchConfig, bench_config, resolve_settings
from cli.bench.serve.cpu_breakdown import breakdown, snapshot
from cli.bench.serve.datasets import build_requests
from cli.bench.serve.plot import plot
from cli.bench.serve.server import ServerProbe
from cli.bench.stats import samples, summarize
from cli.bench.stream_client import RequestResult, resolve_model, stream_request
from cli.bench.workload import BenchRequest
from scheduling.errors import InvalidParameterError


async def send(session: aiohttp.ClientSession, cfg: ServeBenchConfig, model: str, req: BenchRequest
               ) -> RequestResult:
    """Send one streaming request and time it (``stream_request``); never raises for server or network errors."""
    body = req.body(model, temperature=cfg.temperature, ignore_eos=cfg.ignore_eos)
    return await stream_request(session, cfg.base_url + req.endpoint, body)


async def _run_rate(session: aiohttp.ClientSession, cfg: ServeBenchConfig, model: str,
                    requests: list[BenchRequest], rate: float, probe: ServerProbe) -> dict[str, Any]:
    arrivals = cfg.arrivals(rate)
    offsets = arrival_offsets(len(requests), arrivals)
    gate: asyncio.Semaphore | None = (asyncio.Semaphore(arrivals.max_concurrency)
                                      if arrivals.max_concurrency else None)
    loop = asyncio.get_running_loop()
    start = loop.time()

    async def one(req: BenchRequest, offset: float) -> RequestResult:
        delay = start + offset - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)  # the arrival schedule itself
        async with gate if gate is not None else contextlib.nullcontext():
            sent = loop.time() - start
            r = await send(session, cfg, model, req)
        r.start_s = sent
        return r

    await probe.begin()
    cpu_before = snapshot() if cfg.cpu_breakdown else None
    sampler = loop.create_task(probe.sample_every(cfg.metrics_interval_s))
    try:
        results = await asyncio.gather(*(one(r, o) for r, o in zip(requests, offsets, strict=True)))
    finally:
        sampler.cancel()
        await asyncio.gather(sampler, return_exceptions=True)
    duration = loop.time() - start
    cpu_after = snapshot() if cfg.cpu_breakdown else None
    server = await probe.end(duration)
    summary = summarize(list(results), duration, cfg.slo_ms)
    run: dict[str, Any] = {
        "request_rate": rate if math.isfinite(rate) else "inf",
        "burstiness": cfg.burstiness,
        "max_concurrency": cfg.max_concurrency,
        "num_requests": len(requests),
        **summary,
        "server_metrics": server,
    }
    run["headline"] = {
        "qps": summary["request_throughput"],
        "ttft_p50_ms": summary["ttft_ms"]["p50"], "ttft_p95_ms": summary["ttft_ms"]["p95"],
        "tpot_p50_ms": summary["tpot_ms"]["p50"], "tpot_p95_ms": summary["tpot_ms"]["p95"],
        # Gaps between a stream's output chunks, over every stream: how smooth streaming is (a server that
        # batches tokens into bursts can keep TPOT and still have a high P90 here).
        "itl_ms_p50": summary["itl_ms"]["p50"], "itl_ms_p90": summary["itl_ms"]["p90"],
        "output_tok_per_s": summary["output_throughput"],
        "peak_memory_bytes": server["peak_memory_bytes"],
        "utilization": server["gpu_utilization_perc"] if server["gpu_utilization_perc"] is not None
        else server["cpu_utilization_cores"],
    }
    if cpu_before is not None and cpu_after is not None:
        run["cpu_breakdown"] = breakdown(
            cpu_before, cpu_after, wall_s=duration, num_requests=summary["successful_requests"],
            output_tokens=summary["total_output_tokens"], engine_steps=server["engine_steps"])
    run["samples"] = samples(list(results))
    return run


async def run_async(cfg: ServeBenchConfig) -> dict[str, Any]:
    """Run every rate of ``cfg`` in turn (same requests each time); returns the result document."""
    requests = build_requests(cfg.dataset)
    timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)
    connector = aiohttp.TCPConnector(limit=cfg.max_concurrency or 0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        model = cfg.model or await resolve_model(session, cfg.base_url)
        probe = ServerProbe(session, cfg.base_url)
        for req in requests[: cfg.num_warmups]:  # untimed: first-call costs stay out of the figures
            await send(session, cfg, model, req)
        runs = [await _run_rate(session, cfg, model, requests, rate, probe) for rate in cfg.request_rates]
    config = asdict(cfg)
    config["request_rates"] = [r if math.isfinite(r) else "inf" for r in cfg.request_rates]
    return {"benchmark": "serve", "base_url": cfg.base_url, "model": model, "server": probe.kind,
            "config": config, "runs": runs}


def run(cfg: ServeBenchConfig) -> dict[str, Any]:
    """``run_async`` on a fresh event loop."""
    return asyncio.run(run_async(cfg))


def without_samples(result: dict[str, Any]) -> dict[str, Any]:
    """The result minus per-request samples (what is printed; the file keeps them)."""
    return {**result, "runs": [{k: v for k, v in r.items() if k != "samples"} for r in result["runs"]]}


def _dump(obj: Any) -> str:
    return json.dumps(obj, indent=2, default=lambda v: "inf" if v == math.inf else str(v))


def main(args: argparse.Namespace) -> int:
    """Run ``bench serve`` as ``args`` say; prints the JSON (without per-request samples)."""
    try:
        settings = resolve_settings(vars(args))
        if settings["load"]:
            result = json.loads(Path(settings["load"]).read_text())
        else:
            result = run(bench_config(settings))
    except (InvalidParameterError, OSError, ValueError) as exc:
        print(f"flotilla bench serve: {exc}", file=sys.stderr)
        return 2
    if settings["out"]:
        Path(settings["out"]).write_text(_dump(result) + "\n")
    print(_dump(without_samples(result)), flush=True)
    if settings["plot"]:
        print(f"flotilla bench serve: wrote {plot(result, settings['plot'])}", file=sys.stderr)
    if settings["compare"]:
        base = json.loads(Path(settings["compare"]).read_text())
        rows, regressed = compare(base, result, float(settings["threshold"]))
        print(format_table(rows), file=sys.stderr)
        if regressed:
            print("flotilla bench serve: REGRESSION beyond the threshold", file=sys.stderr)
            return 1
    return 0
