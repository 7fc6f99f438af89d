"""What a replica reports to Serve's controller and routers.

``LLMServer`` inherits this mixin; Serve 2.60 finds the two methods by name:

- ``record_autoscaling_stats``: called every ``look_back_period_s * 0.2`` (at
  most ``metrics_interval_s``); its dict reaches ``SLOAutoscalingPolicy`` as
  ``ctx.aggregated_metrics[key][replica_id]``, averaged over the look-back.
- ``record_routing_stats``: called every ``request_routing_stats_period_s``;
  its dict reaches the router as ``RunningReplica.routing_stats``.

Both read the replica's own ``SchedulerActor`` (``self._actor``) and stream
fan-out (``self._fanout``), which ``LLMServer.__init__`` sets.

Latency: the engine's own window (``EngineStats.ttft_ms_p95``) is bounded by
count (the last 1024 sequences), which at a few requests per second is many
minutes of history: a burst long gone would still read as a breach and keep
the fleet scaling up. The policy needs *recent* latency, so the mixin keeps
``RecentLatency``, the P95 over sequences finished in the last
``LATENCY_WINDOW_S`` seconds, fed with every step's deltas by the observer
``latency_observer`` returns (and none at all while the engine has no work:
then no request is waiting). ``LLMServer`` builds its ``StreamFanout`` with it.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from actors.engine_stats import EngineStats, percentile
from actors.outputs import SequenceDelta
from cluster.autoscaling_metrics import autoscaling_stats
from cluster.request_router import ROUTING_NUM_OPEN

STATS_TIMEOUT_S = 5.0  # below Serve's 10 s limit on record_autoscaling_stats
LATENCY_WINDOW_S = 10.0


class RecentLatency:
    """TTFT/TPOT samples (ms) of sequences that finished in the last ``window_s`` seconds."""

    def __init__(self, window_s: float = LATENCY_WINDOW_S, max_samples: int = 4096) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, float | None, float | None]] = deque(maxlen=max_samples)

    def observe(self, deltas: list[SequenceDelta], now: float) -> None:
        """Record the timings of sequences that ended normally in ``deltas``."""
        for d in deltas:
            t = d.timing
            if t is None or d.finish_reason not in ("stop", "length"):
                continue
            ttft = (t.first_token_time - t.arrival_time) * 1000 if t.first_token_time is not None else None
            tpot = None
            if t.first_token_time is not None and t.last_token_time is not None and t.num_output_tokens > 1:
                tpot = (t.last_token_time - t.first_token_time) * 1000 / (t.num_output_tokens - 1)
            self._samples.append((now, ttft, tpot))

    def p95(self, now: float) -> tuple[float, float]:
        """``(TTFT P95, TPOT P95)`` in ms over the window; 0.0 where it holds no sample."""
        while self._samples and self._samples[0][0] < now - self.window_s:
            self._samples.popleft()
        ttfts = [s[1] for s in self._samples if s[1] is not None]
        tpots = [s[2] for s in self._samples if s[2] is not None]
        return percentile(ttfts, 95), percentile(tpots, 95)


class ReplicaStats:
    """Mixin of ``LLMServer``: ``record_autoscaling_stats`` and ``record_routing_stats``."""

    _actor: Any
    _fanout: Any
    _recent_latency: RecentLatency | None = None

    def latency_observer(
        self, then: Callable[[list[SequenceDelta]], None] | None = None
    ) -> Callable[[list[SequenceDelta]], None]:
        """A fan-out observer that feeds the recent-latency window, then calls ``then``.

        ``LLMServer.__init__`` should build its fan-out with
        ``observer=self.latency_observer(self.metrics.observe)``.
        """
        window = self._recent_latency = self._recent_latency or RecentLatency()

        def observe(deltas: list[SequenceDelta]) -> None:
            if then is not None:
                then(deltas)
            window.observe(deltas, time.monotonic())

        return observe

    async def _engine_stats(self) -> EngineStats:
        stats: EngineStats = await asyncio.wait_for(self._actor.stats.remote(), STATS_TIMEOUT_S)
        return stats

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Waiting and running requests, KV use and recent TTFT/TPOT P95 (ms) of this replica."""
        stats = await self._engine_stats()
        window = self._recent_latency or RecentLatency()  # LLMServer wires it through latency_observer
        ttft, tpot = window.p95(time.monotonic())
        if stats.num_unfinished_requests == 0 and stats.num_waiting == 0 and stats.num_running == 0:
            ttft = tpot = 0.0  # no request is waiting on this replica: no latency to speak of
        return autoscaling_stats(replace(stats, ttft_ms_p95=round(ttft, 3), tpot_ms_p95=round(tpot, 3)))

    async def record_routing_stats(self) -> dict[str, Any]:
        """Requests open on this replica (the router's load figure for replicas it never used)."""
        stats = await self._engine_stats()
        return {ROUTING_NUM_OPEN: int(self._fanout.num_open), "num_waiting": stats.num_waiting,
                "prefix_cache_hit_rate": stats.prefix_cache_hit_rate}
