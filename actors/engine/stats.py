"""Taking the scheduler actor's stats: ``snapshot`` reads an engine into an ``EngineStats``.

``EngineStats`` (the small typed snapshot ``SchedulerActor.stats()``
returns) and ``LatencyWindow`` (the bounded window of recent TTFT and TPOT
samples, so percentiles describe current load, not the whole uptime) cross
to the replica and live in ``actors.api``. The memory figures are read in
the process that calls ``snapshot`` (the one holding the model).
"""

from __future__ import annotations

import os
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from actors.api import EngineStats, LatencyWindow

if TYPE_CHECKING:
    from actors.engine.llm_engine import LLMEngine


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

    ``moe_expert_tokens`` is ``engine.executor.command(ReadExpertTokens())``, read by the
    caller where waiting for the device does not hold up the engine's loop.
    """
    sched, alloc, cache = engine.policy, engine.allocator, engine.policy.cache
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
            r.num_prompt_tokens - r.num_computed_tokens for r in sched.waiting if r.kv_moves.imported is None),
        structured_output_step_seconds=round(engine.grammar_seconds_total, 6),
        lora_requests=tuple(sorted(engine.loras.requests.items())),
        lora_load_seconds=tuple(sorted((n, round(s, 6)) for n, s in engine.loras.load_seconds.items())),
        lora_adapters=tuple(sorted(engine.loras.serving())),
        grammar_compiles_total=num_compiles,
        grammar_compile_seconds_recent=compile_seconds,
        kv_tiers=engine.kv_tiers.stats() if engine.kv_tiers is not None else (),
        moe_expert_tokens=moe_expert_tokens,
    )
