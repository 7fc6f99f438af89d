"""``PrefillServer``: the prefill pool of a disaggregated app (``pd`` in ``build_app``).

A prefill replica owns one ``SchedulerActor``. Decode replicas call
``prefill`` through a Serve handle: it computes the prompt and its first
token and returns them with the prompt's KV pages (``PrefillResult``), which
travel back through Ray's object store. The prompt's pages stay in this
replica's prefix cache, so a hot prefix is computed once per prefill replica.
A decode replica that gives up on a call (``remote_prefill_timeout_s``)
cancels it; the request is then aborted in this replica's scheduler.

Autoscaling: ``record_autoscaling_stats`` reports the engine's queue (the
prefill pool scales on queued prompt tokens) and the recent P95 of the time
to a prefill result as its TTFT (``cluster.autoscaling``, ``pool: prefill``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import ray
from ray import serve

from actors.engine.config import EngineConfig
from actors.engine.disaggregation import PrefillResult
from actors.engine.outputs import SequenceDelta, SequenceTiming
from actors.engine.stats import EngineStats, LatencyWindow
from actors.remote.scheduler_actor import SchedulerActor
from apps.detached import detached
from apps.replica_stats import STATS_TIMEOUT_S, recent_latency_window
from cluster.autoscaling_metrics import autoscaling_stats
from scheduling.sampling_params import SamplingParams

HEALTH_TIMEOUT_S = 10.0


@serve.deployment(max_ongoing_requests=64, health_check_period_s=10.0)
class PrefillServer:
    """One prefill replica: its own SchedulerActor; ``prefill`` is its one method for decode replicas."""

    def __init__(self, engine: dict[str, Any], *, scheduler_options: dict[str, Any] | None = None,
                 startup_timeout_s: float = 600.0) -> None:
        self.config = EngineConfig.from_kwargs(**engine)
        self._actor = SchedulerActor.options(**(scheduler_options or {})).remote(self.config)
        status = ray.get(self._actor.health.remote(), timeout=startup_timeout_s)
        if not status.ok:
            raise RuntimeError(f"the prefill scheduler actor is not healthy: {status.message}")
        self._latency: LatencyWindow = recent_latency_window()
        self._aborts: set[asyncio.Task[None]] = set()  # aborts of cancelled calls still running

    async def prefill(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> PrefillResult:
        """The prompt's first token and KV (see ``SchedulerService.prefill``)."""
        start = time.monotonic()
        try:
            result: PrefillResult = await self._actor.prefill.remote(request_id, prompt_ids, params)
        except asyncio.CancelledError:
            # Cancelling the await does not end the actor's call: abort it there, from a task this
            # cancel does not reach (apps.detached), or its pages stay taken until it finishes.
            task = detached(self._abort(request_id))
            self._aborts.add(task)
            task.add_done_callback(self._aborts.discard)
            raise
        now = time.monotonic()
        # The window reads TTFT from sequence timings: a prefill's is its whole time here.
        timing = SequenceTiming(start, now, now, 1, start)
        self._latency.observe([SequenceDelta(request_id, 0, [], "", None, "length", timing=timing)], now)
        return result

    async def _abort(self, request_id: str) -> None:
        with contextlib.suppress(Exception):  # the actor is gone: nothing left to free
            await self._actor.abort.remote(request_id)

    async def engine_stats(self) -> EngineStats:
        stats: EngineStats = await asyncio.wait_for(self._actor.stats.remote(), STATS_TIMEOUT_S)
        return stats

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Queue figures of the engine and the recent P95 time to a prefill result (as TTFT)."""
        stats = await self.engine_stats()
        idle = stats.num_unfinished_requests == 0 and stats.num_waiting == 0
        ttft = 0.0 if idle else self._latency.ms("ttft", 95, time.monotonic())
        return autoscaling_stats(stats, ttft_ms_p95=ttft, tpot_ms_p95=0.0)

    async def check_health(self) -> None:
        status = await asyncio.wait_for(self._actor.health.remote(), HEALTH_TIMEOUT_S)
        if not status.ok and not status.restarting:
            raise RuntimeError(f"the prefill scheduler actor cannot serve: {status.message}")

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            ray.kill(self._actor, no_restart=True)
