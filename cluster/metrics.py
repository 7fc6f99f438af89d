"""Replica and cluster metrics: vLLM's names with a ``flotilla:`` prefix.

Each replica keeps its figures in a private Prometheus registry, rendered by
its own ``GET /metrics``, and mirrors them into Ray's metrics system
(``ray.util.metrics``, tagged by model and replica) so every replica's figures
reach Ray's one Prometheus endpoint. Ray rejects ``:`` in names, so there the
prefix is ``flotilla_`` and Ray adds ``ray_``: ``flotilla:num_requests_running``
on a replica is ``ray_flotilla_num_requests_running`` on the cluster endpoint.
Counters are declared without ``_total``; both exporters append it.

The families themselves (names, kinds, labels, buckets) are in ``cluster.metric_families``.

Sources: ``observe`` sees every engine step's deltas (tokens, finish reasons,
the finished sequences' timings); ``update`` takes an ``EngineStats`` snapshot
(queue sizes, KV use, cumulative prefix-cache, preemption and
speculative-decoding counters, memory, MoE expert counts). Inter-token
latency is measured where the replica receives tokens, which is what a client
sees. Nothing here raises into the serving path.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from actors.api import EngineStats, FinishReason, SequenceDelta
from cluster.metric_families import (
    REPLICA_FAMILIES,
    REPLICA_LABELS,
    Family,
    family,
)
from kvcache.kv_tiers import TIER_NAMES

logger = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# ------------------------------------------------------------------ Ray mirror
_ray_metrics: dict[str, Any] = {}  # family name -> ray.util.metrics object (one per process)
_ray_failed = False


def _ray_ready() -> bool:
    try:
        import ray

        return bool(ray.is_initialized())
    except Exception:
        return False


def _ray_record(f: Family, value: float, tags: dict[str, str]) -> None:
    """Set, add to or observe ``f`` in Ray's metrics; failures are logged once, never raised."""
    global _ray_failed
    try:
        m: Any = _ray_metrics.get(f.name)
        if m is None:
            from ray.util import metrics as rm

            if f.kind == "gauge":
                m = rm.Gauge(f.ray_name, description=f.help, tag_keys=f.labels)
            elif f.kind == "counter":
                m = rm.Counter(f.ray_name, description=f.help, tag_keys=f.labels)
            else:
                m = rm.Histogram(f.ray_name, description=f.help, boundaries=list(f.buckets), tag_keys=f.labels)
            _ray_metrics[f.name] = m
        if f.kind == "gauge":
            m.set(value, tags=tags)
        elif f.kind == "counter":
            if value > 0:  # Ray refuses inc(0)
                m.inc(value, tags=tags)
        else:
            m.observe(value, tags=tags)
    except Exception:
        if not _ray_failed:
            _ray_failed = True
            logger.exception("recording %s in Ray's metrics failed (logged once)", f.ray_name)


# ------------------------------------------------------------------- replica
_GPU = ("gpu_memory_used_bytes", "gpu_memory_total_bytes", "gpu_utilization_perc")
_NO_ZERO_SAMPLE = (*_GPU, "moe_expert_load_imbalance")  # absent until known (no GPU, a dense model: never)
# The expert-load imbalance window closes once every MoE layer routed this many tokens per expert on average:
# with fewer, chance alone lifts the busiest expert above the mean. An even router's max/mean at 256 is about
# 1.09 (8 experts, top-2) to 1.16 (128 experts, top-8); at 64, 1.17 to 1.33.
MOE_WINDOW_MEAN_TOKENS = 256


class ReplicaMetrics:
    """One replica's metrics: fed every step's deltas and engine-stats snapshots.

    ``export_to_ray`` mirrors every figure into ``ray.util.metrics`` (default:
    when Ray is initialised in this process). ``max_tracked`` bounds the
    per-sequence state kept for inter-token latency (oldest dropped first,
    e.g. sequences whose final delta never arrived because the engine died).
    Ray's copy of the inter-token histogram takes at most ``ray_itl_per_step``
    samples of each step (each Ray observation costs time on the step's
    path; a step's gaps are nearly equal), so there its quantiles hold but
    its count is not a token count: use ``generation_tokens`` for that.
    """

    def __init__(self, model_name: str, replica_id: str, *, export_to_ray: bool | None = None,
                 clock: Callable[[], float] = time.monotonic, max_tracked: int = 65536,
                 ray_itl_per_step: int = 8) -> None:
        self.model_name, self.replica_id = model_name, replica_id
        self.registry = CollectorRegistry(auto_describe=True)
        self._tags = {"model_name": model_name, "replica": replica_id}
        self._ray = _ray_ready() if export_to_ray is None else export_to_ray
        self._clock = clock
        self._max_tracked = max_tracked
        self._ray_itl_per_step = ray_itl_per_step
        self._families = {f.name: f for f in REPLICA_FAMILIES}
        self._prom: dict[str, Any] = {}
        self._children: dict[tuple[str, ...], Any] = {}  # (family, extra label values) -> labelled child
        for f in REPLICA_FAMILIES:
            kind = {"gauge": Gauge, "counter": Counter}.get(f.kind)
            if kind is not None:
                self._prom[f.name] = kind(f.exposition_name, f.help, f.labels, registry=self.registry)
            else:
                self._prom[f.name] = Histogram(f.exposition_name, f.help, f.labels, buckets=f.buckets,
                                               registry=self.registry)
            if f.name not in _NO_ZERO_SAMPLE and f.labels == REPLICA_LABELS:  # more labels: children as values appear
                self._prom[f.name].labels(**self._tags)  # a zero sample before any traffic
        for reason in FinishReason:
            self._prom["request_success"].labels(**self._tags, finished_reason=reason.value)
        self._last_token_at: dict[tuple[str, int], float] = {}  # sequence -> when its last token came
        self._seen: dict[tuple[str, ...], float] = {}  # (family, extra label values) -> counter as last read
        self._moe_window_start: tuple[tuple[int, ...], ...] = ()  # expert counts where the imbalance window began
        self._task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------- recording
    def record(self, name: str, value: float) -> None:
        """Add ``value`` to a counter, observe it in a histogram or set a gauge: the family ``name``."""
        self._record(name, value)

    def _record(self, name: str, value: float, *, to_ray: bool = True, **extra: str) -> None:
        f = self._families[name]
        key = (name, *extra.values())
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self._prom[name].labels(**self._tags, **extra)
        if f.kind == "gauge":
            child.set(value)
        elif f.kind == "counter":
            child.inc(value)
        else:
            child.observe(value)
        if self._ray and to_ray:
            _ray_record(f, value, {**self._tags, **extra})

    def _advance(self, name: str, total: float, **extra: str) -> None:
        """Add what a cumulative engine counter gained since last read (a restarted engine starts over)."""
        key = (name, *extra.values())
        last = self._seen.get(key, 0.0)
        gained = total - last if total >= last else total
        self._seen[key] = total
        if gained > 0:
            self._record(name, gained, to_ray=True, **extra)  # named: mypy then reads extra as labels only

    def observe(self, deltas: list[SequenceDelta]) -> None:
        """Every delta the replica receives (finishing ones carry timings)."""
        now = self._clock()
        num_prompt = num_generated = 0
        ray_itl_left = self._ray_itl_per_step
        for d in deltas:
            key = (d.request_id, d.index)
            if d.token_ids:
                num_generated += len(d.token_ids)
                last = self._last_token_at.pop(key, None)
                if last is None:
                    if d.index == 0:  # a request's prompt counts once, when its first token comes
                        num_prompt += d.num_prompt_tokens
                else:
                    gap = (now - last) / len(d.token_ids)
                    for _ in d.token_ids:
                        self._record("inter_token_latency_seconds", gap, to_ray=ray_itl_left > 0)
                        ray_itl_left -= 1
                self._last_token_at[key] = now
            elif d.embedding is not None:  # an embedding request: its prompt is all it computes
                num_prompt += d.num_prompt_tokens
            if d.finish_reason is not None:
                self._last_token_at.pop(key, None)
                self._record("request_success", 1, finished_reason=d.finish_reason.value)
                self._observe_timing(d)
        if num_generated:
            self._record("generation_tokens", num_generated)
        if num_prompt:
            self._record("prompt_tokens", num_prompt)
        while len(self._last_token_at) > self._max_tracked:
            del self._last_token_at[next(iter(self._last_token_at))]

    def _observe_timing(self, d: SequenceDelta) -> None:
        t = d.timing
        if t is None:
            return
        if t.ttft_s is not None:
            self._record("time_to_first_token_seconds", max(t.ttft_s, 0.0))
        if t.queue_time_s is not None:
            self._record("request_queue_time_seconds", max(t.queue_time_s, 0.0))
        if d.finish_reason is not None and d.finish_reason.completed:
            if t.e2e_s is not None:
                self._record("e2e_request_latency_seconds", max(t.e2e_s, 0.0))
            if t.tpot_s is not None:
                self._record("request_time_per_output_token_seconds", max(t.tpot_s, 0.0))

    def update(self, stats: EngineStats) -> None:
        """Refresh gauges and counters from a snapshot of the engine."""
        total = stats.num_kv_pages_total
        held = total - stats.num_kv_pages_free - stats.num_kv_pages_evictable
        self._record("num_requests_running", stats.num_running)
        self._record("num_requests_waiting", stats.num_waiting)
        self._record("kv_cache_usage_perc", held / total if total else 0.0)
        self._advance("prefix_cache_queries", stats.prefix_cache_queries_tokens)
        self._advance("prefix_cache_hits", stats.prefix_cache_hits_tokens)
        self._advance("num_preemptions", stats.num_preemptions)
        self._advance("engine_steps", stats.num_steps)
        self._advance("engine_forward_seconds", stats.forward_seconds_total)
        self._advance("process_cpu_seconds", stats.cpu_seconds_total)
        self._advance("spec_decode_num_drafts", stats.spec_decode_num_drafts)
        self._advance("spec_decode_num_draft_tokens", stats.spec_decode_num_draft_tokens)
        self._advance("spec_decode_num_accepted_tokens", stats.spec_decode_num_accepted_tokens)
        for pos, accepted in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
            self._advance("spec_decode_num_accepted_tokens_per_pos", accepted, position=str(pos))
        for kind, count in stats.structured_output_requests:
            self._advance("structured_output_requests", count, kind=kind)
        self._advance("structured_output_step_seconds", stats.structured_output_step_seconds)
        for adapter, count in stats.lora_requests:
            self._advance("lora_requests", count, adapter=adapter)
        for adapter, seconds in stats.lora_load_seconds:
            self._record("lora_load_seconds", seconds, adapter=adapter)
        self._observe_compiles(stats.grammar_compiles_total, stats.grammar_compile_seconds_recent)
        for tier, counters in stats.kv_tiers:
            if tier not in TIER_NAMES:
                continue  # the engine's own counts (load timeouts, dropped saves) are in its stats
            values = dict(counters)
            for name in ("lookups", "hits", "bytes_read", "bytes_written", "load_seconds", "errors"):
                self._advance(f"kv_tier_{name}", values[name], tier=tier)
            self._record("kv_tier_bytes", values["bytes"], tier=tier)
        if stats.moe_expert_tokens:
            for expert, total in enumerate(map(sum, zip(*stats.moe_expert_tokens, strict=True))):
                self._advance("moe_expert_tokens", total, expert=str(expert))
            self._observe_expert_load(stats.moe_expert_tokens)
        self._record("memory_used_bytes", stats.memory_used_bytes)
        self._record("memory_peak_bytes", stats.memory_peak_bytes)
        self._record("memory_limit_bytes", stats.memory_limit_bytes)
        for name in _GPU:
            value = getattr(stats, name)
            if value is not None:
                self._record(name, value)

    def _observe_expert_load(self, counts: tuple[tuple[int, ...], ...]) -> None:
        """The imbalance gauge over the tokens routed since the window began (at first, since the engine started).

        Set once every MoE layer routed ``MOE_WINDOW_MEAN_TOKENS`` per expert
        in the window, which then starts again; until then the gauge holds.
        """
        start = self._moe_window_start
        if len(start) != len(counts) or any(now < then for row, base in zip(counts, start, strict=True)
                                            for now, then in zip(row, base, strict=True)):
            start = self._moe_window_start = tuple((0,) * len(row) for row in counts)  # new, or restarted (from 0)
        window = [[now - then for now, then in zip(row, base, strict=True)]
                  for row, base in zip(counts, start, strict=True)]
        if min(sum(layer) for layer in window) < MOE_WINDOW_MEAN_TOKENS * len(window[0]):
            return
        self._record("moe_expert_load_imbalance", max(max(layer) * len(layer) / sum(layer) for layer in window))
        self._moe_window_start = counts

    def _observe_compiles(self, total: int, recent: tuple[float, ...]) -> None:
        """Observe the compiles finished since the last snapshot (the newest of ``recent``)."""
        key = ("grammar_compile_seconds",)
        last = int(self._seen.get(key, 0))
        new = total - last if total >= last else total  # a restarted engine counts from 0
        self._seen[key] = total
        for seconds in recent[len(recent) - min(new, len(recent)):]:
            self._record("grammar_compile_seconds", seconds)

    def render(self) -> bytes:
        """The Prometheus text exposition of this replica's metrics."""
        return generate_latest(self.registry)

    # ------------------------------------------------------------- reporting
    def start_reporting(self, fetch: Callable[[], Awaitable[EngineStats]], interval_s: float = 5.0) -> None:
        """Keep Ray's copy of the gauges fresh: ``update(await fetch())`` every ``interval_s``.

        Call on the replica's event loop; idempotent, and restarts a task that ended.
        """
        if self._task is None or self._task.done():
            # An empty context: started from a Serve call, it must not be cancelled with that call.
            self._task = asyncio.get_running_loop().create_task(self._report(fetch, interval_s),
                                                                context=contextvars.Context())

    def stop_reporting(self) -> None:
        """Cancel the reporting task (no wait)."""
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _report(self, fetch: Callable[[], Awaitable[EngineStats]], interval_s: float) -> None:
        while True:
            try:
                self.update(await asyncio.wait_for(fetch(), timeout=max(interval_s, 1.0) * 2))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the engine is down: keep the last figures
                logger.debug("metrics refresh failed: %r", exc)
            await asyncio.sleep(interval_s)  # a period, not a synchronisation


# ------------------------------------------------------------------- cluster
@dataclass(frozen=True, slots=True)
class ScalingDecision:
    """One autoscaling decision as recorded (kept per deployment for inspection)."""

    deployment: str
    current_replicas: int
    target_replicas: int
    reason: str
    time: float


_decisions: dict[str, ScalingDecision] = {}


def record_scaling_decision(deployment: str, current_replicas: int, target_replicas: int, reason: str) -> None:
    """Record an autoscaling decision in Ray's metrics; never raises.

    Sets ``flotilla:num_replicas`` and ``flotilla:target_replicas`` for the
    deployment, and counts ``flotilla:scaling_decisions{direction, reason}``
    when the target differs from the current count. Callable from the Serve
    controller's autoscaling policy (any process; a no-op for Ray when Ray is
    not initialised there).
    """
    with contextlib.suppress(Exception):
        current, target = int(current_replicas), int(target_replicas)
        _decisions[str(deployment)] = ScalingDecision(str(deployment), current, target, str(reason), time.time())
        if not _ray_ready():
            return
        tags = {"deployment": str(deployment)}
        _ray_record(family("num_replicas"), current, tags)
        _ray_record(family("target_replicas"), target, tags)
        if target != current:
            direction = "up" if target > current else "down"
            _ray_record(family("scaling_decisions"), 1, {**tags, "direction": direction, "reason": str(reason)})


def last_scaling_decision(deployment: str) -> ScalingDecision | None:
    """The last decision recorded in this process for ``deployment``."""
    return _decisions.get(deployment)
