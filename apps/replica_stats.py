"""What a replica reports to Serve's controller (placeholder; being implemented)."""

from __future__ import annotations


class ReplicaStats:
    """Mixin of ``LLMServer``: ``record_autoscaling_stats`` and ``record_routing_stats``."""
