"""When ``flotilla bench serve`` sends each request: a rate (Poisson or gamma) or as fast as allowed.

With ``request_rate`` finite, gaps between requests are drawn from a gamma
distribution of mean ``1 / rate`` and shape ``burstiness`` (1.0 is a Poisson
process; below 1 burstier, above 1 more regular). With an infinite rate every
request is due at once and ``max_concurrency`` alone paces the run (a fixed
concurrency). Both may be combined.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from scheduling.errors import InvalidParameterError


@dataclass(frozen=True, slots=True)
class ArrivalConfig:
    """How requests arrive: ``request_rate`` per second (``inf``: all at once), burstiness, concurrency cap."""

    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise InvalidParameterError("request_rate", f"must be > 0 (inf for all at once), got {self.request_rate}")
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise InvalidParameterError("burstiness", f"must be a finite number > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise InvalidParameterError("max_concurrency", f"must be >= 1, got {self.max_concurrency}")


def arrival_offsets(n: int, cfg: ArrivalConfig) -> list[float]:
    """Send times (seconds after the start) of ``n`` requests; non-decreasing, the first at 0."""
    if n < 0:
        raise InvalidParameterError("num_prompts", f"must be >= 0, got {n}")
    if math.isinf(cfg.request_rate):
        return [0.0] * n
    rng = random.Random(cfg.seed)
    scale = 1.0 / (cfg.request_rate * cfg.burstiness)  # mean gap = shape * scale = 1 / rate
    out, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.gammavariate(cfg.burstiness, scale)
        out.append(t)
    return out


def parse_rates(value: str | float | int | list[float | int | str]) -> list[float]:
    """One rate or a sweep: ``4``, ``"inf"``, ``"1,2,4"`` or a YAML list."""
    items = value if isinstance(value, list) else str(value).split(",")
    rates = []
    for item in items:
        try:
            rate = float(item)
        except ValueError as exc:
            raise InvalidParameterError("request_rate", f"not a number: {item!r}") from exc
        if not rate > 0:
            raise InvalidParameterError("request_rate", f"must be > 0 (inf for all at once), got {rate}")
        rates.append(rate)
    if not rates:
        raise InvalidParameterError("request_rate", "give at least one rate")
    return rates
