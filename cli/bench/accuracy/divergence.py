"""Where greedy outputs part, and how close the base's own choice was there.

Greedy agreement is all-or-nothing per request: one flipped argmax anywhere
changes the rest of the output. Whether a flip says much about a
quantization depends on how close the base model itself was to choosing
otherwise. ``divergences`` reports, for each request whose outputs differ,
the first position where they part and the base's top-1 minus top-2 logit
gap there (``base_margin``); ``margin_quantiles`` summarises, over every
request, the smallest such gap along the base output. A request whose
smallest gap is tiny flips under any perturbation of its logits larger than
that gap, whatever its cause (docs/quantization.md: the gaps on SmolLM2, and
the bfloat16 yardstick that flips such requests too).
"""

from __future__ import annotations

from typing import Any

import torch


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where ``a`` and ``b`` differ (one ending counts), or None when equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def top2_gaps(logits: torch.Tensor) -> torch.Tensor:
    """Top-1 minus top-2 logit of each row (float32)."""
    top = logits.float().topk(2, dim=-1).values
    return top[:, 0] - top[:, 1]


def divergences(base: list[list[int]], against: list[list[int]], base_logits: list[torch.Tensor]
                ) -> list[dict[str, Any]]:
    """One entry per request whose outputs differ: its index, the position, and the base's gap there."""
    found = []
    for i, (a, b, logits) in enumerate(zip(base, against, base_logits, strict=True)):
        pos = first_difference(a, b)
        if pos is None:
            continue
        margin = float(top2_gaps(logits[pos:pos + 1])[0]) if pos < logits.shape[0] else None
        found.append({"request": i, "position": pos, "base_margin": margin})
    return found


def margin_quantiles(base_logits: list[torch.Tensor]) -> dict[str, float]:
    """Quantiles over requests of each one's smallest top-2 gap along the base output."""
    smallest = torch.tensor([float(top2_gaps(lg).min()) for lg in base_logits if lg.shape[0]])
    if not smallest.numel():
        return {}
    qs = torch.quantile(smallest, torch.tensor([0.0, 0.1, 0.25, 0.5]))
    return {name: round(float(v), 5) for name, v in zip(("min", "p10", "p25", "p50"), qs, strict=True)}
