"""Counters the scheduler keeps for metrics and benchmarks."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class SchedulerStats:
    """Cumulative counters since the scheduler started."""

    num_steps: int = 0
    num_preemptions: int = 0
    prefix_queries_tokens: int = 0
    prefix_hit_tokens: int = 0

    @property
    def prefix_hit_rate(self) -> float:
        if self.prefix_queries_tokens == 0:
            return 0.0
        return self.prefix_hit_tokens / self.prefix_queries_tokens
