"""What the benchmarks share to run: a private Ray cluster and Serve, an app deployed and healthy, offline engines.

Ray and Serve (``bench autoscale``, ``bench pd``, ``bench ray-overhead``):
token auth is off for these private, loopback-only clusters
(``RAY_AUTH_MODE=disabled`` unless the user set it): it guards shared
clusters, and nothing but this process reaches these.

Offline engines (``bench offline``, ``spec``, ``accuracy``, ``structured
overhead``): ``OFFLINE_ENGINE_DEFAULTS``, a warm-up of ``WARMUP_REQUESTS``,
``measure`` (one timed pass over a workload) and ``batch1`` (one request
alone: prefill and batch-1 decode tok/s).
"""

from __future__ import annotations

import contextlib
import os
import socket
import statistics
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from apps.llm import LLM
from scheduling.sampling_params import SamplingParams

# Offline benchmarks repeat their prompts (warm-up, runs, A/B passes): with the prefix cache on, later
# passes would skip the prefills being measured, so it is off unless a run asks for it.
OFFLINE_ENGINE_DEFAULTS: dict[str, Any] = {"enable_prefix_caching": False}
WARMUP_REQUESTS = 2  # sent untimed first, as the peers do: first-call costs stay out of the figures
BATCH1_RUNS = 3


# ------------------------------------------------------------------- Ray and Serve
# Ray, Serve and apps.builder are imported in the functions below, not at the top: the offline
# benchmarks import this module too, never start Ray, and report their peak RSS, which
# importing Serve would raise by itself.

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(url: str, timeout_s: float = 300.0, alive: Callable[[], bool] | None = None) -> None:
    """Until ``url/health`` answers 200; ``TimeoutError`` after ``timeout_s``, ``RuntimeError`` once ``alive``
    (the server's process, when the caller started one) says it has gone."""
    deadline = time.monotonic() + timeout_s
    while True:
        if alive is not None and not alive():
            raise RuntimeError(f"the server of {url} exited before it was healthy")
        with contextlib.suppress(OSError, ValueError), urllib.request.urlopen(f"{url}/health", timeout=10) as resp:
            if resp.status == 200:
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} never became healthy")
        time.sleep(0.5)  # polling a server that is starting


@contextlib.contextmanager
def local_ray(num_cpus: int) -> Iterator[int]:
    """A local Ray cluster and Serve on a free loopback port (yields the port)."""
    import ray  # see the section comment: not loaded for the offline benchmarks
    from ray import serve

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield port
    finally:
        serve.shutdown()
        ray.shutdown()


@contextlib.contextmanager
def ray_running(num_cpus: int) -> Iterator[None]:
    """Ray for this process, without Serve: the cluster already up, else a private one stopped on exit."""
    import ray  # see the section comment: not loaded for the offline benchmarks

    started = not ray.is_initialized()
    if started:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        # address="local": a cluster of its own, never one another process left running on this machine.
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        if started:
            ray.shutdown()


@contextlib.contextmanager
def serve_on(num_cpus: int, serve_port: int | None) -> Iterator[int]:
    """Serve's HTTP port for a benchmark's apps: ``serve_port``, where this process already runs Ray and Serve
    on it (a caller that shares its cluster, as the test session does), else a private cluster's (``local_ray``)."""
    if serve_port is not None:
        yield serve_port
        return
    with local_ray(num_cpus) as port:
        yield port


def deploy(app_arguments: dict[str, Any], port: int, name: str) -> str:
    """Run ``build_app(app_arguments)`` as Serve app ``name`` at ``/name``; returns its URL once healthy.

    Its own route prefix, not ``/``: other apps (another mode's, or a shared cluster's) may run beside it."""
    from ray import serve  # see the section comment: not loaded for the offline benchmarks

    from apps.builder import build_app

    serve.run(build_app(app_arguments), name=name, route_prefix=f"/{name}")
    url = f"http://127.0.0.1:{port}/{name}"
    wait_healthy(url)
    return url


# ------------------------------------------------------------------- offline engines

@contextlib.contextmanager
def offline_engine(options: dict[str, Any]) -> Iterator[LLM]:
    """An engine that is shut down on exit (a benchmark that builds two frees the first before the second)."""
    llm = LLM(**options)
    try:
        yield llm
    finally:
        llm.shutdown()


@dataclass(frozen=True, slots=True)
class Pass:
    """One engine's run of the whole workload."""

    seconds: float
    output_tokens: int
    engine_steps: int
    token_ids: list[list[int]]

    @property
    def tok_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0


def measure(llm: LLM, prompts: list[list[int]], params: list[SamplingParams], progress: bool) -> Pass:
    """One timed pass of every prompt with default batching (``llm.generate``)."""
    steps0 = llm.engine.policy.stats.num_steps
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=progress)
    dt = time.perf_counter() - t0
    ids = [list(o.outputs[0].token_ids) for o in outs]
    return Pass(dt, sum(len(t) for t in ids), llm.engine.policy.stats.num_steps - steps0, ids)


def batch1(llm: LLM, prompt: list[int], num_tokens: int) -> dict[str, Any]:
    """Prefill and decode speed of one request alone (medians of ``BATCH1_RUNS``), stepping the engine.

    A run's first step is the whole prefill (prefill tok/s = prompt tokens /
    that step's time); the median of its other steps gives batch-1 decode tok/s.
    """
    engine = llm.engine
    if engine.has_unfinished:
        raise RuntimeError("batch-1 needs an idle engine")
    prefill: list[float] = []
    decode: list[float] = []
    for k in range(BATCH1_RUNS + 1):  # the first run warms up and is not counted
        engine.add_request(f"batch1-{k}", prompt, SamplingParams(max_tokens=num_tokens, temperature=0.0,
                                                                 ignore_eos=True))
        steps: list[float] = []
        while engine.has_unfinished:
            t0 = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t0)
        if k and len(steps) > 1:
            prefill.append(len(prompt) / steps[0])
            decode.append(1.0 / statistics.median(steps[1:]))
    return {"prompt_tokens": len(prompt), "output_tokens": num_tokens, "runs": BATCH1_RUNS,
            "prefill_tok_per_s": round(statistics.median(prefill), 1),
            "decode_tok_per_s": round(statistics.median(decode), 2)}
