"""Per-pool autoscaling of a disaggregated (``pd``) app on a real local Serve.

A steady load of long, distinct prompts queues prompt tokens on the prefill
pool (whose replica computes them slowly: two sequences, 64-token chunks), so
the prefill pool scales 1 -> 2 on its own signal (queued prompt tokens over
``target_prompt_tokens_per_replica``) while the decode pool, which only
receives the prefilled KV and decodes two tokens of each, stays at one
replica; once the load stops the prefill pool goes back to one. Every KV page
is free on both sides afterwards.
"""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import pytest
from ray import serve

from actors.api import EngineStats
from tests.serve_harness import ACTOR_NAMESPACE, TIMEOUT, LiveServer, http, live_server, poll_until

pytestmark = pytest.mark.ray  # on the session's shared cluster: run with the other Ray modules, last (tests/conftest.py)

DECODE_ACTOR = "pd-autoscale-decode-scheduler"
APP = "pd-autoscale"  # beside the session's tiny app on the shared cluster (tests.serve_harness.live_server)
PREFILL, DECODE = "PrefillServer", "LLMServer"
SMALL_ACTOR = {"num_cpus": 0.1}  # replica capacity, not the machine's 4 CPUs, is what runs out
MIN_TOKENS = 64
# Eight clients in flight keep ~6 prompts of ~1,200 tokens queued on a prefill replica whose target is 2,000.
CONCURRENCY = 8
MAX_REQUESTS = 400
PREFILL_AUTOSCALING = {"min_replicas": 1, "max_replicas": 2, "target_prompt_tokens_per_replica": 2000,
                       # The queued-token signal is the one under test; TTFT on a shared CPU box is not.
                       "slo_ttft_ms": 600_000, "upscale_delay_s": 1, "downscale_delay_s": 3,
                       "metrics_interval_s": 0.5, "look_back_period_s": 1.0}
# Decode: ordinary targets for running and waiting sequences (the load never approaches them: its
# requests reach the decode replica one prefill at a time and decode two tokens each); TPOT out of play.
DECODE_AUTOSCALING = {"min_replicas": 1, "max_replicas": 2, "target_running_per_replica": 8,
                      "target_queue_per_replica": 4, "slo_tpot_ms": 600_000, "upscale_delay_s": 1,
                      "downscale_delay_s": 3, "metrics_interval_s": 0.5, "look_back_period_s": 1.0}
SCALE_DEADLINE_S = 60.0  # a replica start takes ~9 s on an idle 2-core box, ~30 s on a busy one


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[LiveServer]:
    pd = {"remote_prefill_min_tokens": MIN_TOKENS,
          # Slow prefill on purpose: two sequences, 64 tokens a step, so the load stays queued for seconds.
          "prefill": {"max_num_seqs": 2, "max_num_batched_tokens": 64, "autoscaling": PREFILL_AUTOSCALING,
                      "replica_options": SMALL_ACTOR, "scheduler_options": SMALL_ACTOR,
                      "graceful_shutdown_timeout_s": 30},
          "decode": {"num_kv_pages": 512, "autoscaling": DECODE_AUTOSCALING}}
    scheduler = {"name": DECODE_ACTOR, "namespace": ACTOR_NAMESPACE, **SMALL_ACTOR}
    with live_server(tiny_model_dir, APP, actor_name=DECODE_ACTOR, pd=pd, scheduler_options=scheduler,
                     replica_options=SMALL_ACTOR, graceful_shutdown_timeout_s=30) as live:
        yield live


def replica_states(deployment: str) -> dict[str, int]:
    """``{state: count}`` of ``deployment``'s replicas (RUNNING, STARTING, STOPPING, ...)."""
    status = serve.status().applications[APP].deployments[deployment]
    return {str(state).rsplit(".", 1)[-1]: int(n) for state, n in status.replica_states.items() if n}


@dataclass
class Watch:
    """Samples both pools' replica states on every poll, so a decode scale-up at any moment is seen."""

    start: float = field(default_factory=time.monotonic)
    samples: list[tuple[float, dict[str, int], dict[str, int]]] = field(default_factory=list)

    def sample(self) -> tuple[dict[str, int], dict[str, int]]:
        prefill, decode = replica_states(PREFILL), replica_states(DECODE)
        self.samples.append((round(time.monotonic() - self.start, 2), prefill, decode))
        return prefill, decode

    def max_decode_replicas(self) -> int:
        return max(sum(decode.values()) for _, _, decode in self.samples)

    def timeline(self) -> str:
        """The samples where something changed."""
        changes, last = [], None
        for t, prefill, decode in self.samples:
            if (prefill, decode) != last:
                changes.append(f"{t}s prefill={prefill} decode={decode}")
                last = (prefill, decode)
        return "; ".join(changes)


def prefill_stats() -> EngineStats:
    handle = serve.get_deployment_handle(PREFILL, app_name=APP)
    return cast(EngineStats, handle.engine_stats.remote().result(timeout_s=TIMEOUT))


def remote_prefills(url: str) -> float:
    """The decode replica's ``flotilla:pd_remote_prefills_total``."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=TIMEOUT) as resp:
        metrics = resp.read().decode()
    return sum(float(line.split()[-1]) for line in metrics.splitlines()
               if line.startswith("flotilla:pd_remote_prefills_total"))


def prompt(i: int) -> str:
    """~1,200 byte-level tokens, distinct from the first page on: no prompt is a cached prefix of another."""
    return f"[burst {i:03d}] " + f"entry {i} of the harbour master's log, tide and cargo; " * 22


def complete(url: str, prompt: str) -> tuple[int, Any]:
    return http(f"{url}/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 2,
                                          "temperature": 0.0, "ignore_eos": True})


class Load:
    """``CONCURRENCY`` clients sending long, distinct prompts back to back until ``stop`` (at most
    ``MAX_REQUESTS`` in all, a bound in case the scale-up never comes); ``stop`` joins them."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.results: list[tuple[int, Any]] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._sent = 0
        self._pool = ThreadPoolExecutor(CONCURRENCY)
        self._clients = [self._pool.submit(self._client) for _ in range(CONCURRENCY)]

    def _client(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                if self._sent >= MAX_REQUESTS:
                    return
                i, self._sent = self._sent, self._sent + 1
            result = complete(self.url, prompt(i))
            with self._lock:
                self.results.append(result)

    def stop(self) -> None:
        self._stop.set()
        try:
            for client in self._clients:
                client.result(timeout=TIMEOUT)  # re-raises a client's failure
        finally:
            self._pool.shutdown(wait=True, cancel_futures=True)


def test_prefill_pool_scales_up_under_long_prompts_and_back_down_while_decode_stays(server: LiveServer) -> None:
    watch = Watch()
    poll_until(lambda: watch.sample() == ({"RUNNING": 1}, {"RUNNING": 1}), SCALE_DEADLINE_S,
               lambda: f"pools not at one replica each: {watch.timeline()}")
    start = time.monotonic()
    load = Load(server.url)
    try:
        # Up: the queued prompt tokens ask for a second prefill replica, which starts and runs while the
        # load goes on (were the load gone first, the policy would rightly cancel the start).
        poll_until(lambda: watch.sample()[0].get("RUNNING", 0) == 2, SCALE_DEADLINE_S,
                   lambda: f"the prefill pool never ran 2 replicas ({len(load.results)} requests done): "
                           f"{watch.timeline()}")
        up_s = time.monotonic() - start
    finally:
        load.stop()
    stopped_s = time.monotonic() - start
    assert [status for status, _ in load.results] == [200] * len(load.results), \
        [body for status, body in load.results if status != 200][:2]
    assert all(body["usage"]["completion_tokens"] == 2 for _, body in load.results)
    # Down: the load is gone, so after the downscale delay the prefill pool is one replica again.
    poll_until(lambda: watch.sample()[0] == {"RUNNING": 1}, SCALE_DEADLINE_S,
               lambda: f"the prefill pool never went back to 1: {watch.timeline()}")
    down_s = time.monotonic() - start
    # The decode pool held one replica the whole time (sampled on every poll above).
    assert watch.max_decode_replicas() == 1, watch.timeline()
    assert watch.samples[-1][2] == {"RUNNING": 1}, watch.timeline()
    print(f"{len(load.results)} requests; prefill at 2 running after {up_s:.1f}s, load stopped and drained at "
          f"{stopped_s:.1f}s, back to 1 at {down_s:.1f}s; {watch.timeline()}")
    # Every prompt was computed on the prefill pool, and nothing is left behind on either side.
    assert remote_prefills(server.url) == len(load.results)
    stats = prefill_stats()
    assert stats.num_unfinished_requests == 0 and stats.num_kv_pages_locked == 0, stats
    server.assert_pages_free()
