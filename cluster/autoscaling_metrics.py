"""What replicas report to the autoscaling policy, and how the policy reads it back.

A replica's ``record_autoscaling_stats`` returns ``autoscaling_stats(engine
stats, recent latency)``; Serve averages each key per replica over ``look_back_period_s`` and
hands them to the policy as ``ctx.aggregated_metrics``, which
``loads_from_metrics`` turns into one ``ReplicaLoad`` per replica.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from actors.api import EngineStats, LatencyWindow

# Keys of the custom metrics a replica reports through ``record_autoscaling_stats``.
METRIC_NUM_WAITING = "flotilla_num_waiting"
METRIC_NUM_RUNNING = "flotilla_num_running"
METRIC_KV_USAGE = "flotilla_kv_usage"
METRIC_TTFT_P95_MS = "flotilla_ttft_ms_p95"
METRIC_TPOT_P95_MS = "flotilla_tpot_ms_p95"
METRIC_NUM_WAITING_PROMPT_TOKENS = "flotilla_num_waiting_prompt_tokens"
# The recent-latency window a replica reports P95s over (``apps.replica.stats`` explains why it is bounded by age).
LATENCY_WINDOW_S = 10.0


def recent_latency_window() -> LatencyWindow:
    """A replica's window: the last ``LATENCY_WINDOW_S`` seconds (at most 4096 sequences); the simulator's
    replicas (``cli.simulate``) keep the same one."""
    return LatencyWindow(4096, max_age_s=LATENCY_WINDOW_S)


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """What one replica reports: queue, batch, KV use (0..1), latency P95s in ms, queued prompt tokens.

    ``num_waiting_prompt_tokens``: prompt tokens its waiting requests still
    have to compute (the prefill pool's load; ``cluster.autoscaling_pools``).
    """

    num_waiting: float = 0.0
    num_running: float = 0.0
    kv_usage: float = 0.0
    ttft_p95_ms: float = 0.0
    tpot_p95_ms: float = 0.0
    num_waiting_prompt_tokens: float = 0.0


def autoscaling_stats(stats: EngineStats, *, ttft_ms_p95: float, tpot_ms_p95: float) -> dict[str, float]:
    """The metrics a replica returns from ``record_autoscaling_stats``.

    Queue (requests and their prompt tokens still to compute) and KV figures
    come from the engine's ``stats``; the latency P95s
    are the replica's recent window (``apps.replica.stats``), passed apart
    so the engine's own, longer window is never mistaken for them.
    KV use counts only pages owned or pinned by running requests: prefix-cache
    pages that can be evicted at once are free capacity, not load.
    """
    total = stats.num_kv_pages_total
    busy = stats.num_kv_pages_used - stats.num_kv_pages_evictable
    return {
        METRIC_NUM_WAITING: float(stats.num_waiting),
        METRIC_NUM_RUNNING: float(stats.num_running),
        METRIC_KV_USAGE: busy / total if total > 0 else 0.0,
        METRIC_TTFT_P95_MS: ttft_ms_p95,
        METRIC_TPOT_P95_MS: tpot_ms_p95,
        METRIC_NUM_WAITING_PROMPT_TOKENS: float(stats.num_waiting_prompt_tokens),
    }


def loads_from_metrics(metrics: dict[str, dict[Any, float]] | None) -> list[ReplicaLoad]:
    """Per-replica loads from ``ctx.aggregated_metrics`` (metric -> replica -> value).

    A replica appears once it has reported ``METRIC_NUM_WAITING``; a metric it
    has not reported yet reads as 0.
    """
    metrics = metrics or {}
    waiting = metrics.get(METRIC_NUM_WAITING, {})

    def get(key: str, replica: Any) -> float:
        return float(metrics.get(key, {}).get(replica, 0.0))

    return [
        ReplicaLoad(
            num_waiting=float(waiting[r]),
            num_running=get(METRIC_NUM_RUNNING, r),
            kv_usage=get(METRIC_KV_USAGE, r),
            ttft_p95_ms=get(METRIC_TTFT_P95_MS, r),
            tpot_p95_ms=get(METRIC_TPOT_P95_MS, r),
            num_waiting_prompt_tokens=get(METRIC_NUM_WAITING_PROMPT_TOKENS, r),
        )
        for r in waiting
    ]
