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
each process of the serving path used (``cli.bench.cpu_breakdown``).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp

from cli.bench.cpu_breakdown import breakdown, snapshot
from cli.bench.serve_arrivals import ArrivalConfig, arrival_offsets
from cli.bench.serve_datasets import BenchRequest, DatasetConfig, build_requests
from cli.bench.serve_report import samples, summarize
from cli.bench.serve_server import ServerProbe
from cli.bench.stream_client import RequestResult, stream_request


@dataclass(frozen=True, slots=True)
class ServeBenchConfig:
    """One benchmark: where, what, how fast (a list of rates is a sweep)."""

    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None  # None: the first of /v1/models
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    request_rates: tuple[float, ...] = (math.inf,)
    burstiness: float = 1.0
    max_concurrency: int | None = None
    ignore_eos: bool = True
    temperature: float = 0.0
    slo_ms: dict[str, float] = field(default_factory=dict)
    timeout_s: float = 600.0
    num_warmups: int = 1
    metrics_interval_s: float = 1.0
    cpu_breakdown: bool = False  # per-process CPU of the serving path (the server on this host)

    def arrivals(self, rate: float) -> ArrivalConfig:
        return ArrivalConfig(rate, self.burstiness, self.max_concurrency, self.dataset.seed)


def request_body(req: BenchRequest, model: str, cfg: ServeBenchConfig) -> dict[str, Any]:
    """The JSON body of one streaming request."""
    body: dict[str, Any] = {"model": model, "max_tokens": req.max_tokens, "temperature": cfg.temperature,
                            "stream": True, "stream_options": {"include_usage": True}}
    if cfg.ignore_eos:
        body["ignore_eos"] = True  # vLLM's extension, also flotilla's: every request does its full work
    if req.messages is not None:
        body["messages"] = req.messages
    else:
        body["prompt"] = req.prompt
    return body


async def send_request(session: aiohttp.ClientSession, base_url: str, body: dict[str, Any],
                       endpoint: str) -> RequestResult:
    """Send one streaming request and time it (``stream_request``); never raises for server or network errors."""
    return await stream_request(session, base_url + endpoint, body)


async def resolve_model(session: aiohttp.ClientSession, base_url: str) -> str:
    """The first model ``/v1/models`` lists."""
    async with session.get(base_url + "/v1/models") as resp:
        resp.raise_for_status()
        data = await resp.json()
    return str(data["data"][0]["id"])


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
            r = await send_request(session, cfg.base_url, request_body(req, model, cfg), req.endpoint)
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
            await send_request(session, cfg.base_url, request_body(req, model, cfg), req.endpoint)
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
