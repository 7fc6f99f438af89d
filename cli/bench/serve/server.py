"""Server-side figures for ``flotilla bench serve``, scraped from a flotilla server's ``/metrics``.

A scrape reaches one replica (``cli.bench.metrics``), so figures are kept per
``replica`` label: peak memory is the largest seen, CPU
utilisation sums what each replica seen at both ends of a run used. Servers
without ``flotilla:`` metrics get null figures and ``kind`` "vllm" or "unknown".
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp

from cli.bench.metrics import fetch, flotilla_samples
from cluster.metric_families import PREFIX

WANTED = ("memory_used_bytes", "memory_peak_bytes", "memory_limit_bytes", "process_cpu_seconds_total",
          "gpu_utilization_perc", "gpu_memory_used_bytes", "engine_steps_total",
          "engine_forward_seconds_total")


def parse_flotilla_metrics(text: str) -> dict[str, dict[str, float]]:
    """``{replica: {figure: value}}`` of the ``flotilla:`` samples in ``WANTED``."""
    out: dict[str, dict[str, float]] = {}
    for s in flotilla_samples(text):
        name = s.name[len(PREFIX):]
        if name in WANTED:
            out.setdefault(s.labels.get("replica", ""), {})[name] = float(s.value)
    return out


class ServerProbe:
    """Scrapes ``base_url/metrics`` around and during a run; every failure just yields no figure."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str) -> None:
        self.session, self.base_url = session, base_url
        self.kind = "unknown"
        self._start: dict[str, dict[str, float]] = {}
        self._last: dict[str, dict[str, float]] = {}
        self._peak = 0.0
        self._max_used = 0.0
        self._gpu_util: list[float] = []
        self._gpu_mem = 0.0

    async def scrape(self) -> dict[str, dict[str, float]]:
        """One scrape, folded into the running maxima; ``{}`` when it failed or is not flotilla."""
        try:
            text = await fetch(self.session, self.base_url)
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return {}
        if PREFIX in text:
            self.kind = "flotilla"
        elif "vllm:" in text and self.kind == "unknown":
            self.kind = "vllm"
        try:
            figures = parse_flotilla_metrics(text)
        except ValueError:
            return {}
        for replica, f in figures.items():
            self._last[replica] = f
            self._peak = max(self._peak, f.get("memory_peak_bytes", 0.0), f.get("memory_used_bytes", 0.0))
            self._max_used = max(self._max_used, f.get("memory_used_bytes", 0.0))
            self._gpu_mem = max(self._gpu_mem, f.get("gpu_memory_used_bytes", 0.0))
            if "gpu_utilization_perc" in f:
                self._gpu_util.append(f["gpu_utilization_perc"])
        return figures

    async def begin(self) -> None:
        """Start a run: reset the maxima and note each replica's CPU seconds."""
        self._peak = self._max_used = self._gpu_mem = 0.0
        self._gpu_util = []
        self._start = {r: dict(f) for r, f in (await self.scrape()).items()}

    async def sample_every(self, interval_s: float) -> None:
        """Scrape until cancelled (memory can peak between the run's ends)."""
        while True:
            await asyncio.sleep(interval_s)  # a sampling period, not a synchronisation
            with contextlib.suppress(Exception):
                await self.scrape()

    async def end(self, duration_s: float) -> dict[str, Any]:
        """Finish a run: the server figures (null where not flotilla or never seen)."""
        await self.scrape()
        if self.kind != "flotilla" or not self._last:
            return {"kind": self.kind, "peak_memory_bytes": None, "max_memory_used_bytes": None,
                    "memory_limit_bytes": None, "cpu_utilization_cores": None, "gpu_utilization_perc": None,
                    "gpu_memory_used_bytes": None, "engine_steps": None, "engine_forward_ms_per_step": None,
                    "replicas_seen": 0}
        cpu = self._advanced("process_cpu_seconds_total")
        steps = self._advanced("engine_steps_total")
        forward = self._advanced("engine_forward_seconds_total")
        limits = [f["memory_limit_bytes"] for f in self._last.values() if "memory_limit_bytes" in f]
        return {
            "kind": self.kind,
            "peak_memory_bytes": int(self._peak) or None,
            "max_memory_used_bytes": int(self._max_used) or None,
            "memory_limit_bytes": int(max(limits)) if limits else None,
            "cpu_utilization_cores": round(sum(cpu) / duration_s, 3) if cpu and duration_s > 0 else None,
            "gpu_utilization_perc": round(sum(self._gpu_util) / len(self._gpu_util), 1) if self._gpu_util else None,
            "gpu_memory_used_bytes": int(self._gpu_mem) or None,
            "engine_steps": int(sum(steps)) if steps else None,
            # The forward's own time per step, to set beside `flotilla bench offline`'s: what the serving
            # path's processes, sharing the cores, cost the forward.
            "engine_forward_ms_per_step": (round(sum(forward) * 1e3 / sum(steps), 3)
                                           if forward and steps and sum(steps) > 0 else None),
            "replicas_seen": len(self._last),
        }

    def _advanced(self, name: str) -> list[float]:
        """How far counter ``name`` moved on each replica seen at both ends of the run."""
        return [self._last[r][name] - s[name] for r, s in self._start.items()
                if r in self._last and name in s and name in self._last[r]]
