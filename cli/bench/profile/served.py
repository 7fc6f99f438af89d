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
"""

from __future__ import annotations

import asyncio
import statistics
import sys
from typing import Any

import aiohttp

from actors.load.embedded import VOCAB_SIZE
from cli.bench.harness import deploy, local_ray
from cli.bench.profile.run import Shape, check_settings, report, step_shapes
from cli.bench.stream_client import RequestResult, stream_request
from cli.simulate.profile import Capacity
from scheduling.errors import InvalidParameterError

APP = "flotilla-profile"


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


def run_served(model: str, *, runs: int = 3, steps: int = 8, seed: int = 0, num_cpus: int = 4,
               prefill_tokens: tuple[int, ...], decode_batches: tuple[int, ...], decode_contexts: tuple[int, ...],
               **engine: Any) -> dict[str, Any]:
    """Profile one served replica of ``model`` (module docstring); ``engine`` holds its engine options."""
    check_settings(runs, steps)
    if "num_kv_pages" not in engine:
        raise InvalidParameterError("num_kv_pages", "--served needs the replica's KV pool (--num-kv-pages): "
                                                    "the profile records it, and the app cannot report it back")
    options = {"max_num_seqs": max(decode_batches), "max_num_batched_tokens": max(prefill_tokens),
               "max_model_len": max(max(prefill_tokens) + 2, max(decode_contexts) + steps + 4),
               "enable_prefix_caching": False, "device": "cpu", **engine}
    if max(prefill_tokens) > options["max_num_batched_tokens"]:
        raise InvalidParameterError("max_num_batched_tokens", "is below the largest prefill")
    shapes = step_shapes(prefill_tokens, decode_batches, decode_contexts, steps=steps, vocab=VOCAB_SIZE, seed=seed)
    with local_ray(num_cpus) as port:
        url = deploy({"model": model, "served_model_name": "profiled", "num_replicas": 1, **options}, port, APP)
        _status(f"{len(shapes)} shapes x {runs} runs through {url}")
        times = asyncio.run(_measure(url, shapes, runs, steps))
    capacity = Capacity(int(options["num_kv_pages"]), 16, int(options["max_num_seqs"]),
                        int(options["max_num_batched_tokens"]), int(options["max_model_len"]))
    return report(shapes, times, capacity, f"bench profile --served: {model}, one replica on this machine",
                  runs=runs, steps=steps)
