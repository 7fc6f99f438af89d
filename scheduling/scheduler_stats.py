"""Counters the scheduler keeps for metrics and benchmarks."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SchedulerStats:
    """Cumulative counters since the scheduler started."""

    num_steps: int = 0
    num_preemptions: int = 0
    prefix_queries_tokens: int = 0
    prefix_hit_tokens: int = 0
    tier_hit_tokens: int = 0  # prompt tokens whose KV the KV tiers loaded (``scheduling.kv_tiers``)
    # Speculative decoding (vLLM's spec_decode_* counters): a "draft" is one
    # sequence's draft tokens verified in one step; ``..._per_pos[i]`` counts
    # drafts whose token at position i (0-based) was accepted.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    @property
    def prefix_hit_rate(self) -> float:
        if self.prefix_queries_tokens == 0:
            return 0.0
        return self.prefix_hit_tokens / self.prefix_queries_tokens

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted draft tokens over proposed ones (0 before any draft)."""
        if self.spec_num_draft_tokens == 0:
            return 0.0
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens

    def record_draft(self, num_draft_tokens: int, num_accepted: int) -> None:
        """Count one sequence's verified draft: ``num_accepted`` of its ``num_draft_tokens`` kept."""
        self.spec_num_drafts += 1
        self.spec_num_draft_tokens += num_draft_tokens
        self.spec_num_accepted_tokens += num_accepted
        per_pos = self.spec_num_accepted_tokens_per_pos
        if len(per_pos) < num_draft_tokens:
            per_pos.extend([0] * (num_draft_tokens - len(per_pos)))
        for i in range(num_accepted):
            per_pos[i] += 1
