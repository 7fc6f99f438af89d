"""``flotilla bench profile --served``: the same step shapes, timed as a client of a served replica sees them.

A replica's step on this machine costs more than its forward: the scheduler
actor's loop, the Ray hop of every step's tokens to the replica, the stream
to the client. So for simulating the served app (``flotilla simulate``
against ``flotilla bench autoscale``), the shapes are timed through one
replica of the real app on a local Ray cluster (the engine options as
given), over HTTP on loopback:

- **prefill** of ``T`` tokens: the time to the first token of one request of
  ``T`` prompt token ids and one output token, alone;
- **decode** of ``B`` sequences at context ``C``: ``B`` requests at once of
  ``C`` prompt tokens and ``steps + 1`` output tokens; each request's time
  per output token after its first (the step interval it saw), their
  median.

Each figure is the median over ``runs`` after one warm-up; the fit and
report are the offline command's (``cli.bench.profile.run``).

**How replicas share the host** (``host_replicas``): replicas on one
machine share its cores with each other, their scheduler actors, the proxy
and the client, so K busy replicas each step slower than one. For each K
(1 always included), an app of K replicas takes K x B requests at once (at
the shortest context) of ``HOST_STEPS``
output tokens; the median step interval they see, over one with K = 1, is
K's slowdown. Then, with the most replicas, ``HOST_WAITING_PER_REPLICA`` x K
one-token requests are sent behind the busy ones: a waiting request is an
open HTTP stream and a queued entry for the proxy, the replica and the
scheduler actor, and a deep backlog slows every step. Its share of the host,
as a fraction of a busy replica, is ``host_share_per_waiting`` (``K x
(step_waiting / step_K - 1) / waiting``). ``start_s`` is how long each app of K replicas took to deploy
(all K starting at once, on an otherwise idle host): a guide to
``simulate``'s ``startup_s``. The simulator's
rule is ``slowdown = max(1, K / host_cores)`` (``cli.simulate.fleet``), so
``host_cores`` is fitted to the slowdowns by least squares
(``1 / host_cores = sum(K x s_K) / sum(K^2)``) and recorded in the profile.
B here is the replicas' ``max_num_seqs``: the router spreads the K x B
requests, every slot runs one.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from typing import Any

import aiohttp
from ray import serve

from actors.load.embedded import VOCAB_SIZE
from cli.bench.decode_steps import random_prompts
from cli.bench.engine_options import SHARED_ACTOR_CPUS
from cli.bench.harness import deploy, serve_on
from cli.bench.profile.run import Shape, check_settings, report, step_shapes
from cli.bench.stream_client import RequestResult, stream_request
from cli.simulate.profile import Capacity
from scheduling.errors import InvalidParameterError

APP = "flotilla-profile"
# Output tokens of each request timing the host share: long enough that every replica's requests decode
# together for most of their time (with only a few tokens each, requests sent at once to several replicas
# hardly overlap, and the host share comes out too small).
HOST_STEPS = 128
# Decode steps timed per shape: a stream's first few tokens come out faster than its steady rate, so a
# short count under-states the step a long stream sees (docs/fleet.md; ``--steps`` overrides it).
SERVED_STEPS = 64
# Requests per replica kept waiting behind the busy slots to time what a queue costs the host: enough
# that the queue's cost shows above the host's noise.
HOST_WAITING_PER_REPLICA = 64


def _status(message: str) -> None:
    print(f"flotilla bench profile --served: {message}", file=sys.stderr, flush=True)


async def _one(session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int) -> RequestResult:
    body = {"model": "profiled", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    result = await stream_request(session, f"{url}/v1/completions", body)
    if not result.ok:
        raise RuntimeError(f"a profiling request failed: {result.error}")
    return result


async def _time_shape(session: aiohttp.ClientSession, url: str, shape: Shape, steps: int) -> float:
    name, _, prompts = shape
    if name.startswith("prefill"):
        result = await _one(session, url, prompts[0], 1)
        assert result.ttft_s is not None
        return result.ttft_s
    results = await asyncio.gather(*(_one(session, url, p, steps + 1) for p in prompts))
    per_token = [t for r in results if (t := r.tpot_s) is not None]
    return statistics.median(per_token)


async def _measure(url: str, shapes: list[Shape], runs: int, steps: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name, _, _ in shapes}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        for r in range(runs + 1):  # run 0 warms up and is not counted
            for shape in shapes:
                seconds = await _time_shape(session, url, shape, steps)
                if r:
                    times[shape[0]].append(seconds)
            _status(f"run {r}/{runs} done")
    return times


def fit_host_cores(slowdowns: dict[int, float]) -> float:
    """``host_cores`` of ``slowdown = max(1, K / host_cores)`` fitted to measured ``{K: slowdown}`` (module
    docstring); K = 1 is the reference and does not count."""
    rows = [(k, s) for k, s in slowdowns.items() if k > 1]
    if not rows:
        raise InvalidParameterError("host_replicas", "needs at least one K above 1")
    return sum(k * k for k, _ in rows) / sum(k * s for k, s in rows)


async def _time_replicas(url: str, prompts: list[list[int]], waiting: list[list[int]], runs: int) -> list[float]:
    """The median step interval of ``prompts`` (``HOST_STEPS`` tokens each) sent at once, with ``waiting``
    one-token requests sent behind them (they wait for the slots), ``runs`` times after one warm-up."""
    out: list[float] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        for r in range(runs + 1):
            running = [asyncio.ensure_future(_one(session, url, p, HOST_STEPS + 1)) for p in prompts]
            queued = [asyncio.ensure_future(_one(session, url, p, 1)) for p in waiting]
            results = await asyncio.gather(*running)
            await asyncio.gather(*queued)
            if r:
                out.append(statistics.median(t for x in results if (t := x.tpot_s) is not None))
    return out


def _host_share(port: int, app: dict[str, Any], replicas: tuple[int, ...], context: int, one: tuple[str, float], *,
                runs: int, seed: int) -> dict[str, Any]:
    """Each K's step interval with K replicas busy, the slowdowns, the fitted ``host_cores``, and the host
    share of a waiting request (module docstring); ``one`` is the running app of one replica (its URL and
    the seconds it took to start)."""
    batch = int(app["max_num_seqs"])  # every slot of every replica runs: the waiting requests wait
    step_s: dict[int, float] = {}
    start_s: dict[int, float] = {}
    top = max({1, *replicas})
    waiting = random_prompts(HOST_WAITING_PER_REPLICA * top, context, VOCAB_SIZE, seed + 15485863)
    waited = 0.0
    for k in sorted({1, *replicas}):
        name = f"{APP}-host{k}"  # a fresh app per K: the proxy keeps one router per deployment id
        if k == 1:
            url, start_s[k] = one
        else:
            t0 = time.perf_counter()
            url = deploy({**app, "num_replicas": k}, port, name)
            start_s[k] = time.perf_counter() - t0
        prompts = random_prompts(k * batch, context, VOCAB_SIZE, seed + 104729 * k)
        step_s[k] = statistics.median(asyncio.run(_time_replicas(url, prompts, [], runs)))
        _status(f"{k} replicas busy: step interval {step_s[k] * 1e3:.2f} ms")
        if k == top:
            waited = statistics.median(asyncio.run(_time_replicas(url, prompts, waiting, runs)))
            _status(f"{k} replicas busy, {len(waiting)} requests waiting: step interval {waited * 1e3:.2f} ms")
        serve.delete(APP if k == 1 else name)  # an idle replica left running would share the host too
    slowdown = {k: t / step_s[1] for k, t in step_s.items()}
    host_cores = fit_host_cores(slowdown)
    # (top + share x waiting) / host_cores = slowdown with the waiting requests; top / host_cores without.
    share = max(0.0, top * (waited / step_s[top] - 1) / len(waiting))
    return {"replicas": list(step_s), "step_ms": [round(t * 1e3, 3) for t in step_s.values()],
            "slowdown": [round(s, 3) for s in slowdown.values()], "host_cores": round(host_cores, 3),
            "waiting": len(waiting), "waiting_step_ms": round(waited * 1e3, 3),
            "host_share_per_waiting": round(share, 5), "batch": batch, "context": context,
            "output_tokens": HOST_STEPS + 1, "start_s": [round(t, 1) for t in start_s.values()]}


def run_served(model: str, *, runs: int = 3, steps: int = SERVED_STEPS, seed: int = 0, num_cpus: int = 4,
               prefill_tokens: tuple[int, ...], decode_batches: tuple[int, ...], decode_contexts: tuple[int, ...],
               host_replicas: tuple[int, ...] = (), serve_port: int | None = None,
               **engine: Any) -> dict[str, Any]:
    """Profile one served replica of ``model`` (module docstring); ``engine`` holds its engine options.
    ``serve_port``: Serve of the cluster this process already runs (``harness.serve_on``); None starts a
    private one."""
    check_settings(runs, steps)
    if "num_kv_pages" not in engine:
        raise InvalidParameterError("num_kv_pages", "--served needs the replica's KV pool (--num-kv-pages): "
                                                    "the profile records it, and the app cannot report it back")
    options = {"max_num_seqs": max(decode_batches), "max_num_batched_tokens": max(prefill_tokens),
               "max_model_len": max(max(prefill_tokens) + 2, max(decode_contexts) + steps + 4,
                                    min(decode_contexts) + HOST_STEPS + 4 if host_replicas else 0),
               "enable_prefix_caching": False, "device": "cpu", **engine}
    if max(prefill_tokens) > options["max_num_batched_tokens"]:
        raise InvalidParameterError("max_num_batched_tokens", "is below the largest prefill")
    shapes = step_shapes(prefill_tokens, decode_batches, decode_contexts, steps=steps, vocab=VOCAB_SIZE, seed=seed)
    if host_replicas and (min(host_replicas) < 1 or max(host_replicas) < 2):
        raise InvalidParameterError("host_replicas", f"needs counts >= 1, one of them above 1; got {host_replicas}")
    app = {"model": model, "served_model_name": "profiled", **options,
           "replica_options": {"num_cpus": SHARED_ACTOR_CPUS},
           "scheduler_options": {"num_cpus": SHARED_ACTOR_CPUS}}
    host: dict[str, Any] | None = None
    with serve_on(num_cpus, serve_port) as port:
        t0 = time.perf_counter()
        url = deploy({**app, "num_replicas": 1}, port, APP)
        started = time.perf_counter() - t0
        _status(f"{len(shapes)} shapes x {runs} runs through {url}")
        times = asyncio.run(_measure(url, shapes, runs, steps))
        if host_replicas:
            host = _host_share(port, app, host_replicas, min(decode_contexts), (url, started), runs=runs,
                               seed=seed)
    capacity = Capacity(int(options["num_kv_pages"]), 16, int(options["max_num_seqs"]),
                        int(options["max_num_batched_tokens"]), int(options["max_model_len"]))
    out = report(shapes, times, capacity, f"bench profile --served: {model}, one replica on this machine",
                 runs=runs, steps=steps, host_cores=host["host_cores"] if host else None,
                 host_share_per_waiting=host["host_share_per_waiting"] if host else 0.0)
    return {**out, "host": host} if host else out
