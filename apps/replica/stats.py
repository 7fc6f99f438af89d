"""What a replica reports to Serve's controller and routers.

``LLMServer`` inherits this mixin; Serve 2.60 finds the two methods by name:

- ``record_autoscaling_stats``: called every ``look_back_period_s * 0.2`` (at
  most ``metrics_interval_s``); its dict reaches ``SLOAutoscalingPolicy`` as
  ``ctx.aggregated_metrics[key][replica_id]``, averaged over the look-back.
- ``record_routing_stats``: called every ``request_routing_stats_period_s``;
  its dict reaches the router as ``RunningReplica.routing_stats``.

Both read the replica's own scheduler (``self._scheduler``) and stream
fan-out (``self._fanout``), which ``LLMServer.__init__`` sets.

Latency: both windows are ``actors.api.LatencyWindow`` over the same
``SequenceTiming`` records. The engine's own (``EngineStats.ttft_ms_p95``,
what ``stats()`` and ``/metrics`` show) is bounded by count (the last 1024
sequences), which at a few requests per second is many minutes of history: a
burst long gone would still read as a breach and keep the fleet scaling up.
So the autoscaler reads the replica's window instead, the same class bounded
also by age (``cluster.autoscaling_metrics.recent_latency_window``: sequences finished in the last
``LATENCY_WINDOW_S`` seconds),
fed with every step's deltas by the observer ``latency_observer`` returns
(and reads 0 while the engine has no work: then no request is waiting).
``LLMServer`` builds its ``StreamFanout`` with it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from actors.api import EngineStats, LatencyWindow, SequenceDelta
from actors.scheduler.handle import SchedulerHandle
from apps.outputs.stream_fanout import StreamFanout
from cluster.autoscaling_metrics import autoscaling_stats, recent_latency_window
from cluster.request_router import (
    ROUTING_LORAS,
    ROUTING_NUM_OPEN,
    ROUTING_REPORTED_AT,
    ROUTING_SERVED_MODEL,
)

STATS_TIMEOUT_S = 5.0  # below Serve's 10 s limit on record_autoscaling_stats
HEALTH_TIMEOUT_S = 10.0  # a replica's wait for its scheduler's health or stats (check_health, /health, /metrics)


class ReplicaStats:
    """Mixin of ``LLMServer``: ``record_autoscaling_stats`` and ``record_routing_stats``."""

    _scheduler: SchedulerHandle
    _fanout: StreamFanout
    model_name: str
    _recent_latency: LatencyWindow | None = None

    def latency_observer(
        self, then: Callable[[list[SequenceDelta]], None] | None = None
    ) -> Callable[[list[SequenceDelta]], None]:
        """A fan-out observer that feeds the recent-latency window, then calls ``then``.

        ``LLMServer.__init__`` should build its fan-out with
        ``observer=self.latency_observer(self.metrics.observe)``.
        """
        window = self._recent_latency = self._recent_latency or recent_latency_window()

        def observe(deltas: list[SequenceDelta]) -> None:
            if then is not None:
                then(deltas)
            window.observe(deltas, time.monotonic())

        return observe

    async def engine_stats(self) -> EngineStats:
        """The engine's stats; also for ``DeploymentHandle`` callers (tools, tests), who have no
        scheduler actor to ask when ``scheduler_placement=replica``."""
        return await asyncio.wait_for(self._scheduler.stats(), STATS_TIMEOUT_S)

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Waiting and running requests, KV use and recent TTFT/TPOT P95 (ms) of this replica."""
        stats = await self.engine_stats()
        window = self._recent_latency or recent_latency_window()  # LLMServer wires it via latency_observer
        now = time.monotonic()
        ttft, tpot = window.ms("ttft", 95, now), window.ms("tpot", 95, now)
        if stats.num_unfinished_requests == 0 and stats.num_waiting == 0 and stats.num_running == 0:
            ttft = tpot = 0.0  # no request is waiting on this replica: no latency to speak of
        return autoscaling_stats(stats, ttft_ms_p95=ttft, tpot_ms_p95=tpot)

    async def record_routing_stats(self) -> dict[str, Any]:
        """Requests open on this replica (the router's load figure for replicas it never used)."""
        stats = await self.engine_stats()
        return {ROUTING_NUM_OPEN: int(self._fanout.num_open), ROUTING_REPORTED_AT: time.monotonic(),
                "num_waiting": stats.num_waiting,
                "prefix_cache_hit_rate": stats.prefix_cache_hit_rate, ROUTING_LORAS: list(stats.lora_adapters),
                ROUTING_SERVED_MODEL: self.model_name}
