"""Stats and latency bookkeeping for the scheduler actor.

``LatencyWindow`` keeps the most recent TTFT and TPOT samples in bounded
deques, so percentiles describe current load (not the whole uptime) and
memory stays flat however long the replica runs. ``EngineStats`` is the
small typed snapshot ``SchedulerActor.stats()`` returns.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from actors.outputs import SequenceDelta

if TYPE_CHECKING:
    from actors.engine import LLMEngine


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation; 0.0 when empty."""
    if not values:
        return 0.0
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


class LatencyWindow:
    """The last ``size`` TTFT and TPOT samples (seconds) of finished sequences.

    Only sequences that ended normally ("stop" or "length") count: an aborted
    or failed one would skew the latency a healthy request sees.
    """

    def __init__(self, size: int = 1024) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.ttft_s: deque[float] = deque(maxlen=size)
        self.tpot_s: deque[float] = deque(maxlen=size)

    def observe(self, deltas: list[SequenceDelta]) -> None:
        """Record the timings carried by finishing deltas (others carry none)."""
        for d in deltas:
            t = d.timing
            if t is None or d.finish_reason not in ("stop", "length"):
                continue
            ttft, tpot = t.ttft_s, t.tpot_s
            if ttft is not None:
                self.ttft_s.append(ttft)
            if tpot is not None:
                self.tpot_s.append(tpot)

    def ms(self, which: str, q: float) -> float:
        """Percentile ``q`` of ``"ttft"`` or ``"tpot"`` in milliseconds."""
        window = self.ttft_s if which == "ttft" else self.tpot_s
        return round(percentile(list(window), q) * 1000.0, 3)


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of one replica's engine.

    KV accounting: every page is exactly one of free, cached (held only by
    the prefix cache: ``num_kv_pages_evictable`` of them can be reclaimed at
    once, ``num_kv_pages_locked`` are pinned by running requests' matched
    prefixes) or owned by running requests. With no request in flight,
    ``num_kv_pages_free + num_kv_pages_evictable == num_kv_pages_total``.
    """

    num_waiting: int
    num_running: int
    num_unfinished_requests: int
    num_kv_pages_total: int
    num_kv_pages_free: int
    num_kv_pages_used: int
    num_kv_pages_evictable: int
    num_kv_pages_locked: int
    prefix_cache_hit_rate: float
    num_preemptions: int
    num_steps: int
    ttft_ms_p50: float
    ttft_ms_p95: float
    tpot_ms_p50: float
    tpot_ms_p95: float


def snapshot(engine: LLMEngine, latency: LatencyWindow) -> EngineStats:
    """Read an engine's counters; call it where no step is half-applied (the actor's loop)."""
    sched, alloc, cache = engine.scheduler, engine.allocator, engine.scheduler.cache
    total, free = alloc.num_pages, alloc.num_free_pages
    return EngineStats(
        num_waiting=len(sched.waiting),
        num_running=len(sched.running),
        num_unfinished_requests=engine.num_unfinished_requests,
        num_kv_pages_total=total,
        num_kv_pages_free=free,
        num_kv_pages_used=total - free,
        num_kv_pages_evictable=cache.num_evictable_pages if cache is not None else 0,
        num_kv_pages_locked=cache.num_locked_pages if cache is not None else 0,
        prefix_cache_hit_rate=round(sched.stats.prefix_hit_rate, 4),
        num_preemptions=sched.stats.num_preemptions,
        num_steps=sched.stats.num_steps,
        ttft_ms_p50=latency.ms("ttft", 50),
        ttft_ms_p95=latency.ms("ttft", 95),
        tpot_ms_p50=latency.ms("tpot", 50),
        tpot_ms_p95=latency.ms("tpot", 95),
    )
