"""Replica metrics (placeholder interface; being implemented)."""

from __future__ import annotations

from actors.engine_stats import EngineStats
from actors.outputs import SequenceDelta

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ReplicaMetrics:
    """One replica's metrics: fed every step's deltas and engine-stats snapshots."""

    def __init__(self, model_name: str, replica_id: str) -> None:
        self.model_name, self.replica_id = model_name, replica_id

    def observe(self, deltas: list[SequenceDelta]) -> None:
        """Every delta the replica receives (finishing ones carry timings)."""

    def update(self, stats: EngineStats) -> None:
        """Refresh gauges and counters from a snapshot of the engine."""

    def render(self) -> bytes:
        """The Prometheus text exposition of this replica's metrics."""
        return b""
