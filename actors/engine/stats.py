"""Stats and latency bookkeeping for the scheduler actor.

``LatencyWindow`` keeps the most recent TTFT and TPOT samples in a bounded
deque, so percentiles describe current load (not the whole uptime) and
memory stays flat however long the replica runs. ``EngineStats`` is the
small typed snapshot ``SchedulerActor.stats()`` returns; its memory figures
are read in the process that calls ``snapshot`` (the one holding the model).
"""

from __future__ import annotations

import os
import resource
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from actors.engine.outputs import SequenceDelta

if TYPE_CHECKING:
    from actors.engine.llm_engine import LLMEngine


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
    """TTFT and TPOT samples (seconds) of recently finished sequences: the one latency view.

    Every figure comes from the sequence's ``SequenceTiming`` (its ``ttft_s``
    and ``tpot_s``, the one definition), so the scheduler actor's window, the
    replica's and the Prometheus histograms (``cluster.metrics``) agree on
    what TTFT and TPOT mean. Only sequences that ended normally ("stop" or
    "length") count: an aborted or failed one would skew the latency a
    healthy request sees. The window keeps the last ``size`` samples and,
    with ``max_age_s``, only those observed in the last ``max_age_s``
    seconds (``now`` is the caller's monotonic clock).
    """

    def __init__(self, size: int = 1024, max_age_s: float | None = None) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.max_age_s = max_age_s
        self._samples: deque[tuple[float, float | None, float | None]] = deque(maxlen=size)

    def observe(self, deltas: list[SequenceDelta], now: float | None = None) -> None:
        """Record the timings carried by finishing deltas (others carry none)."""
        for d in deltas:
            t = d.timing
            if t is not None and d.finish_reason in ("stop", "length"):
                self._samples.append((time.monotonic() if now is None else now, t.ttft_s, t.tpot_s))

    def ms(self, which: str, q: float, now: float | None = None) -> float:
        """Percentile ``q`` of ``"ttft"`` or ``"tpot"`` in milliseconds; 0.0 with no sample."""
        if self.max_age_s is not None:
            oldest = (time.monotonic() if now is None else now) - self.max_age_s
            while self._samples and self._samples[0][0] < oldest:
                self._samples.popleft()
        column = 1 if which == "ttft" else 2
        values = [v for sample in self._samples if (v := sample[column]) is not None]
        return round(percentile(values, q) * 1000.0, 3)


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
    # Cumulative prompt tokens looked up in / found in the prefix cache (first admission only).
    prefix_cache_queries_tokens: int = 0
    prefix_cache_hits_tokens: int = 0
    # The snapshotting process: resident set now and at its peak, the memory it
    # may use (cgroup limit or physical RAM, whichever is lower), CPU seconds used.
    memory_used_bytes: int = 0
    memory_peak_bytes: int = 0
    memory_limit_bytes: int = 0
    cpu_seconds_total: float = 0.0
    # Seconds the engine spent in forwards (``LLMEngine.forward_seconds_total``); per step, with num_steps.
    forward_seconds_total: float = 0.0
    # The device this process drives (None without CUDA): memory in use on it
    # (by every process), its size, and its utilisation over the last sample period.
    gpu_memory_used_bytes: int | None = None
    gpu_memory_total_bytes: int | None = None
    gpu_utilization_perc: float | None = None
    # time.time() when taken, so a reader can turn cpu_seconds_total into a rate.
    wall_time: float = 0.0
    # Speculative decoding, cumulative (``SchedulerStats.record_draft``; all zero without it):
    # drafts verified, draft tokens proposed and accepted, and per draft position i the
    # drafts whose token i was accepted. A tuple, so the frozen snapshot shares no list.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()
    # Structured output, cumulative: requests by constraint kind, seconds of the step spent on masks,
    # constraints compiled and the durations of the most recent compiles (``GrammarCompiler.compile_seconds``).
    structured_output_requests: tuple[tuple[str, int], ...] = ()
    structured_output_step_seconds: float = 0.0
    grammar_compiles_total: int = 0
    grammar_compile_seconds_recent: tuple[float, ...] = ()
    # Prompt tokens the waiting requests still have to compute (prefill load; P/D's prefill pool scales on it).
    num_waiting_prompt_tokens: int = 0
    # LoRA (``actors.engine.lora_registry``): per loaded adapter, requests admitted (cumulative) and
    # seconds its load took; adapters in the engine now (loaded, not unloading).
    lora_requests: tuple[tuple[str, int], ...] = ()
    lora_load_seconds: tuple[tuple[str, float], ...] = ()
    lora_adapters: tuple[str, ...] = ()
    # KV tiers (``actors.engine.kv_offload``; empty when off): per tier (host, disk, cluster, and the
    # engine's own counts) its cumulative counters and holdings (``kvcache.kv_tiers.TierStats``).
    kv_tiers: tuple[tuple[str, tuple[tuple[str, float], ...]], ...] = ()
    # Mixture of experts (``Executor.expert_tokens``; empty for a dense model or when unread): per MoE layer,
    # in layer order, per expert, the tokens routed to it since the model loaded (each token counts top_k times).
    moe_expert_tokens: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True, slots=True)
class MemoryUsage:
    """Host and device memory of this process (bytes); device fields None without CUDA."""

    used_bytes: int
    peak_bytes: int
    limit_bytes: int
    cpu_seconds: float
    gpu_used_bytes: int | None = None
    gpu_total_bytes: int | None = None
    gpu_utilization_perc: float | None = None


def _read_int(path: str) -> int | None:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup v2 writes "max" for no limit


def memory_limit_bytes() -> int:
    """What this process may use: the cgroup limit (v2 or v1) when set, else physical RAM."""
    phys = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limits = [x for x in (_read_int("/sys/fs/cgroup/memory.max"),
                          _read_int("/sys/fs/cgroup/memory/memory.limit_in_bytes")) if x]
    return min([phys, *limits])


def _rss_bytes() -> int:
    statm = Path("/proc/self/statm")
    if statm.exists():
        return int(statm.read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return _peak_rss_bytes()  # no procfs (macOS): the peak is the best we have


def _peak_rss_bytes() -> int:
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(kib if sys.platform == "darwin" else kib * 1024)  # macOS reports bytes


def _gpu_usage() -> tuple[int | None, int | None, float | None]:
    """Device memory and utilisation, only where this process already uses CUDA.

    Never initialises CUDA (a CPU replica must not grab a device context).
    """
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None, None, None
    try:
        free, total = torch.cuda.mem_get_info()
    except Exception:
        return None, None, None
    util: float | None
    try:
        util = float(torch.cuda.utilization())  # NVML; absent without pynvml
    except Exception:
        util = None
    return int(total - free), int(total), util


def memory_usage() -> MemoryUsage:
    """Read this process's memory figures now."""
    used, peak = _rss_bytes(), _peak_rss_bytes()
    times = os.times()
    gpu_used, gpu_total, gpu_util = _gpu_usage()
    return MemoryUsage(used, max(peak, used), memory_limit_bytes(), times.user + times.system,
                       gpu_used, gpu_total, gpu_util)


def snapshot(engine: LLMEngine, latency: LatencyWindow,
             moe_expert_tokens: tuple[tuple[int, ...], ...] = ()) -> EngineStats:
    """Read an engine's counters; call it where no step is half-applied (the actor's loop).

    ``moe_expert_tokens`` is ``engine.executor.expert_tokens()``, read by the
    caller where waiting for the device does not hold up the engine's loop.
    """
    sched, alloc, cache = engine.scheduler, engine.allocator, engine.scheduler.cache
    total, free = alloc.num_pages, alloc.num_free_pages
    mem = memory_usage()
    num_compiles, compile_seconds = engine.grammar.compile_seconds()
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
        prefix_cache_queries_tokens=sched.stats.prefix_queries_tokens,
        prefix_cache_hits_tokens=sched.stats.prefix_hit_tokens,
        memory_used_bytes=mem.used_bytes,
        memory_peak_bytes=mem.peak_bytes,
        memory_limit_bytes=mem.limit_bytes,
        cpu_seconds_total=round(mem.cpu_seconds, 3),
        forward_seconds_total=round(engine.forward_seconds_total, 6),
        gpu_memory_used_bytes=mem.gpu_used_bytes,
        gpu_memory_total_bytes=mem.gpu_total_bytes,
        gpu_utilization_perc=mem.gpu_utilization_perc,
        wall_time=time.time(),
        spec_decode_num_drafts=sched.stats.spec_num_drafts,
        spec_decode_num_draft_tokens=sched.stats.spec_num_draft_tokens,
        spec_decode_num_accepted_tokens=sched.stats.spec_num_accepted_tokens,
        spec_decode_num_accepted_tokens_per_pos=tuple(sched.stats.spec_num_accepted_tokens_per_pos),
        structured_output_requests=tuple(sorted(engine.constrained_requests.items())),
        num_waiting_prompt_tokens=sum(
            r.num_prompt_tokens - r.num_computed_tokens for r in sched.waiting if r.kv_import is None),
        structured_output_step_seconds=round(engine.grammar_seconds_total, 6),
        lora_requests=tuple(sorted(engine.loras.requests.items())),
        lora_load_seconds=tuple(sorted((n, round(s, 6)) for n, s in engine.loras.load_seconds.items())),
        lora_adapters=tuple(sorted(engine.loras.serving())),
        grammar_compiles_total=num_compiles,
        grammar_compile_seconds_recent=compile_seconds,
        kv_tiers=engine.offload.stats() if engine.offload is not None else (),
        moe_expert_tokens=moe_expert_tokens,
    )
