"""``flotilla bench lora --served``: adapters chosen by ``model`` through ``flotilla serve``, and the router's hit rate.

For each router (``prefix``: flotilla's, which sends a request naming an
adapter to a replica that has it loaded; ``default``: Serve's power of two
choices) the bench starts ``flotilla serve`` as a user does (the console
script, in its own process and its own private Ray cluster on loopback) with
``replicas`` replicas and ``adapters`` seeded random adapters as
``--lora-modules``. It sends ``requests`` completions through the official
``openai`` client, ``concurrency`` at a time; request ``i`` names adapter
``i mod adapters`` of a seeded shuffle as its ``model`` and, for the router,
in ``X-Flotilla-Model`` (Serve hands a router the headers only). Every reply
must name the adapter asked for. Then it stops the server by its process id.

A replica loads an adapter the first time a request for it arrives there, so
a router that keeps each adapter on one replica loads each once. Figures,
summed over the replicas from ``/metrics`` (a scrape reaches one replica, so
the bench scrapes until every replica has answered): ``lora_requests``,
``resident_hits`` and ``loads`` (``lora_resident_hits`` / ``lora_loads``:
requests that found their adapter loaded on the replica that took them, and
those that waited for a load), ``hit_rate`` = hits / (hits + loads),
``loads_per_adapter`` (1.0 when every adapter lives on one replica,
``replicas`` when on all), the client's ``requests_per_s`` and its latency
median and p95.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
import psutil

from actors.api import percentile
from actors.load.loader import resolve_model_path
from cli.bench.harness import free_port, wait_healthy
from cli.bench.lora.adapters import write_adapters
from cli.bench.metrics import fetch, flotilla_samples
from cluster.metric_families import family
from flotilla.defaults import MODEL_HEADER
from scheduling.errors import InvalidParameterError

ROUTERS = ("prefix", "default")
COUNTERS = ("lora_requests", "lora_resident_hits", "lora_loads")
SCRAPES_PER_REPLICA = 20  # a scrape lands on one replica: this many tries per replica to see them all
STOP_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class ServedSettings:
    """What ``bench lora --served`` runs (the command line's ``--served-*`` flags)."""

    model: str = "tiny"
    replicas: int = 2
    adapters: int = 8
    requests: int = 64
    concurrency: int = 8
    max_tokens: int = 8
    rank: int = 16
    max_loras: int = 4
    router: str = "both"
    seed: int = 0
    cpu_threads: int = 1
    start_timeout_s: float = 300.0

    def check(self) -> None:
        for name in ("replicas", "adapters", "requests", "concurrency", "max_tokens", "rank", "max_loras",
                     "cpu_threads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidParameterError(f"served_{name}", f"must be a positive integer, got {value!r}")
        if self.router not in (*ROUTERS, "both"):
            raise InvalidParameterError("served_router", f"must be one of {(*ROUTERS, 'both')}, got {self.router!r}")

    @property
    def routers(self) -> tuple[str, ...]:
        return ROUTERS if self.router == "both" else (self.router,)


def _flotilla() -> str:
    """The console script beside this interpreter (the venv's), else the one on PATH."""
    here = Path(sys.executable).with_name("flotilla")
    return str(here) if here.exists() else (shutil.which("flotilla") or "flotilla")


@contextlib.contextmanager
def flotilla_serve(args: list[str], log: Path, start_timeout_s: float) -> Iterator[str]:
    """``flotilla serve ARGS`` on a free loopback port until healthy; yields its URL, then stops it by pid.

    Token auth is off for the server's private loopback cluster (as for the
    other benchmarks' clusters, ``cli.bench.harness``). On exit: SIGTERM (the
    CLI shuts Serve and Ray down), then SIGKILL for any of its processes still
    running after ``STOP_TIMEOUT_S``.
    """
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    env.setdefault("RAY_AUTH_MODE", "disabled")
    env.pop("RAY_ADDRESS", None)  # its own cluster, never one this shell points at
    port = free_port()
    with log.open("w") as out:
        proc = psutil.Popen([_flotilla(), "serve", *args, "--host", "127.0.0.1", "--port", str(port)],
                            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, start_timeout_s, alive=lambda: proc.poll() is None)
        except (TimeoutError, RuntimeError) as e:
            raise RuntimeError(f"flotilla serve did not come up: {e}; its log ends:\n"
                               f"{log.read_text()[-3000:]}") from e
        yield url
    finally:
        procs = [proc, *proc.children(recursive=True)] if proc.poll() is None else []
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(signal.SIGTERM)
        _, alive = psutil.wait_procs(procs, timeout=STOP_TIMEOUT_S)
        for p in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        psutil.wait_procs(alive, timeout=10)


def counter_totals(text: str) -> dict[str, dict[str, float]]:
    """``{replica: {counter: value}}`` of ``COUNTERS`` in one scrape (a counter's label sets summed)."""
    sample_of = {family(name).exposition_name + "_total": name for name in COUNTERS}
    out: dict[str, dict[str, float]] = {}
    for s in flotilla_samples(text):
        name = sample_of.get(s.name)
        if name is not None:
            per = out.setdefault(s.labels.get("replica", ""), dict.fromkeys(COUNTERS, 0.0))
            per[name] += float(s.value)
    return out


async def scrape_replicas(url: str, replicas: int) -> dict[str, dict[str, float]]:
    """Every replica's counters: scrapes until ``replicas`` replicas have answered (bounded)."""
    seen: dict[str, dict[str, float]] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        for _ in range(SCRAPES_PER_REPLICA * replicas):
            seen.update(counter_totals(await fetch(session, url)))
            if len(seen) >= replicas:
                break
    return seen


async def send_all(url: str, order: list[str], prompts: list[str], settings: ServedSettings) -> dict[str, Any]:
    """Every request through ``openai.AsyncOpenAI``, ``concurrency`` at a time; latencies and time taken."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    gate = asyncio.Semaphore(settings.concurrency)
    latencies: list[float] = []

    async def one(i: int) -> None:
        async with gate:
            t0 = time.perf_counter()
            reply = await client.completions.create(
                model=order[i], prompt=prompts[i], max_tokens=settings.max_tokens, temperature=0.0,
                extra_headers={MODEL_HEADER: order[i]})  # fmt: skip
            latencies.append(time.perf_counter() - t0)
            if reply.model != order[i]:
                raise RuntimeError(f"request {i} asked for {order[i]!r} and was answered by {reply.model!r}")

    started = time.perf_counter()
    try:
        await asyncio.gather(*(one(i) for i in range(len(order))))
    finally:
        await client.close()
    elapsed = time.perf_counter() - started
    ms = sorted(1e3 * v for v in latencies)
    return {"requests_per_s": round(len(order) / elapsed, 3), "latency_p50_ms": round(percentile(ms, 50), 1),
            "latency_p95_ms": round(percentile(ms, 95), 1), "seconds": round(elapsed, 2)}


def _workload(settings: ServedSettings) -> tuple[list[str], list[str]]:
    """The adapter and the prompt of every request, in send order (seeded)."""
    rng = random.Random(settings.seed)
    names = [f"lora{i}" for i in range(settings.adapters)]
    rng.shuffle(names)
    order = [names[i % len(names)] for i in range(settings.requests)]
    words = ("fleet", "harbor", "signal", "engine", "vector", "cache", "token", "replica", "route", "queue")
    prompts = [" ".join(rng.choice(words) for _ in range(12)) for _ in order]
    return order, prompts


def run_router(router: str, adapters: list[Path], settings: ServedSettings, logs: Path) -> dict[str, Any]:
    """One server with ``router``: the workload through it, and its replicas' counters."""
    modules = [f"lora{i}={path}" for i, path in enumerate(adapters)]
    args = ["--model", settings.model, "--replicas", str(settings.replicas), "--router", router,
            "--lora-modules", *modules, "--max-loras", str(settings.max_loras), "--max-lora-rank", str(settings.rank),
            "--cpu-threads", str(settings.cpu_threads), "--replica-num-cpus", str(1 / settings.replicas)]  # fmt: skip
    order, prompts = _workload(settings)
    with flotilla_serve(args, logs / f"serve-{router}.log", settings.start_timeout_s) as url:
        client = asyncio.run(send_all(url, order, prompts, settings))
        per_replica = asyncio.run(scrape_replicas(url, settings.replicas))
    if len(per_replica) < settings.replicas:
        raise RuntimeError(f"router {router}: /metrics answered from {len(per_replica)} of {settings.replicas} "
                           f"replicas in {SCRAPES_PER_REPLICA * settings.replicas} scrapes")
    total = {name: sum(r[name] for r in per_replica.values()) for name in COUNTERS}
    hits, loads = total["lora_resident_hits"], total["lora_loads"]
    return {
        "lora_requests": int(total["lora_requests"]),
        "resident_hits": int(hits),
        "loads": int(loads),
        "hit_rate": round(hits / (hits + loads), 4) if hits + loads else None,
        "loads_per_adapter": round(loads / settings.adapters, 3),
        "per_replica": {r: {k: int(v) for k, v in c.items()} for r, c in sorted(per_replica.items())},
        **client,
    }


def run_served(settings: ServedSettings) -> dict[str, Any]:
    """Every router's run (module docstring); the JSON-ready result."""
    settings.check()
    model_dir = resolve_model_path(settings.model)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="flotilla-bench-lora-served-") as tmp:
        adapters = write_adapters(model_dir, Path(tmp), settings.adapters, rank=settings.rank, seed=settings.seed)
        runs = {router: run_router(router, adapters, settings, Path(tmp)) for router in settings.routers}
    return {
        "benchmark": "lora-served",
        "model": settings.model,
        "replicas": settings.replicas,
        "adapters": settings.adapters,
        "requests": settings.requests,
        "routers": runs,
        "settings": {"concurrency": settings.concurrency, "max_tokens": settings.max_tokens, "rank": settings.rank,
                     "max_loras": settings.max_loras, "seed": settings.seed, "cpu_threads": settings.cpu_threads},
        "seconds": round(time.perf_counter() - started, 1),
    }
