"""Step plans the attention tests share."""

from __future__ import annotations

from collections.abc import Iterator


def chunked_prefill(prompts: dict[int, int], budget: int) -> Iterator[list[tuple[int, int]]]:
    """Steps of (sequence, query tokens) that prefill ``prompts`` (sequence -> prompt tokens) under a per-step
    token ``budget``, as chunked prefill does: sequences already prefilled decode one token each step (taking
    budget first), the others get the budget left in order, until every prompt is done."""
    remaining = dict(prompts)
    while any(remaining.values()):
        left, work = budget, []
        for s in prompts:
            if remaining[s] == 0:
                work.append((s, 1))
                left -= 1
            elif left > 0:
                n = min(remaining[s], left)
                remaining[s], left = remaining[s] - n, left - n
                work.append((s, n))
        yield work
