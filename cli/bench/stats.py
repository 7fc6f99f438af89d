"""The benchmarks' statistics: latency and goodput over the requests of a run, ratios and medians of figures.

A run's per-request outcomes (``RequestResult``) become one summary dict:
counts, duration, throughputs, TTFT/TPOT/ITL/E2E mean and percentiles in
milliseconds, and goodput under SLOs (``bench serve`` and ``bench pd`` report
these). ``ratio`` and ``median_of_known`` are how every report divides and
summarises figures that may be missing.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from actors.api import percentile
from scheduling.errors import InvalidParameterError

if TYPE_CHECKING:  # annotations only: the statistics read results, they need no HTTP client
    from cli.bench.stream_client import RequestResult

SLO_METRICS = ("ttft", "tpot", "itl", "e2e")
PERCENTILES = (50, 90, 95, 99)


def parse_slo(items: list[str] | dict[str, float] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` (or the same as a dict) -> ``{"ttft": 500.0, "tpot": 50.0}`` (ms)."""
    if not items:
        return {}
    pairs = list(items.items()) if isinstance(items, dict) else [tuple(s.split(":", 1)) for s in items]
    out: dict[str, float] = {}
    for pair in pairs:
        if len(pair) != 2:
            raise InvalidParameterError("slo", f"expected METRIC:MS, got {':'.join(map(str, pair))!r}")
        name, value = str(pair[0]).strip().lower(), pair[1]
        if name not in SLO_METRICS:
            raise InvalidParameterError("slo", f"unknown metric {name!r}; use one of {', '.join(SLO_METRICS)}")
        try:
            ms = float(value)
        except ValueError as exc:
            raise InvalidParameterError("slo", f"{name}: not a number of milliseconds: {value!r}") from exc
        if not ms > 0:
            raise InvalidParameterError("slo", f"{name}: must be > 0 ms, got {ms}")
        out[name] = ms
    return out


def check_count(name: str, value: object) -> None:
    """A benchmark's count setting (runs, steps, a batch): an integer >= 1, else refused by ``name``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidParameterError(name, f"must be an integer >= 1, got {value!r}")


def _meets(r: RequestResult, slo: dict[str, float]) -> bool:
    values = {"ttft": r.ttft_s, "tpot": r.tpot_s, "e2e": r.e2e_s, "itl": max(r.itl_s) if r.itl_s else None}
    for name, limit_ms in slo.items():
        v = values[name]
        if v is not None and v * 1000.0 > limit_ms:
            return False
        if v is None and name in ("ttft", "e2e"):  # no token at all: cannot have met it
            return False
    return True


def latency_stats(values_s: list[float]) -> dict[str, float | None]:
    """Mean and P50/P90/P95/P99 in milliseconds (None when there are no samples)."""
    if not values_s:
        return {"mean": None, **{f"p{q}": None for q in PERCENTILES}}
    ms = [v * 1000.0 for v in values_s]
    return {"mean": round(sum(ms) / len(ms), 3), **{f"p{q}": round(percentile(ms, q), 3) for q in PERCENTILES}}


def summarize(results: list[RequestResult], duration_s: float, slo: dict[str, float]) -> dict[str, Any]:
    """The run's figures from its requests' outcomes (failed requests count only as failures)."""
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    dur = max(duration_s, 1e-9)
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    errors: dict[str, int] = {}
    for r in failed:
        errors[r.error or "unknown"] = errors.get(r.error or "unknown", 0) + 1
    summary: dict[str, Any] = {
        "successful_requests": len(ok),
        "failed_requests": len(failed),
        "errors": dict(sorted(errors.items(), key=lambda kv: -kv[1])[:5]),
        "usage_reported": bool(ok),  # a request is ok only with the server's usage (stream_client)
        "duration_s": round(duration_s, 3),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": round(len(ok) / dur, 4),
        "output_throughput": round(out_tokens / dur, 3),
        "total_token_throughput": round((in_tokens + out_tokens) / dur, 3),
        "ttft_ms": latency_stats([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_ms": latency_stats([t for r in ok if (t := r.tpot_s) is not None]),
        "itl_ms": latency_stats([g for r in ok for g in r.itl_s]),
        "e2e_ms": latency_stats([r.e2e_s for r in ok if r.e2e_s is not None]),
        "goodput": None,
    }
    if slo:
        good = sum(1 for r in ok if _meets(r, slo))
        summary["goodput"] = {"slo_ms": slo, "good_requests": good,
                              "request_throughput": round(good / dur, 4),
                              "fraction": round(good / len(results), 4) if results else 0.0}
    return summary


def samples(results: list[RequestResult]) -> dict[str, list[float]]:
    """Per-request latencies (ms) of successful requests, for CDF plots."""
    ok = [r for r in results if r.ok]
    return {
        "ttft_ms": [round(r.ttft_s * 1000.0, 3) for r in ok if r.ttft_s is not None],
        "tpot_ms": [round(t * 1000.0, 3) for r in ok if (t := r.tpot_s) is not None],
        "e2e_ms": [round(r.e2e_s * 1000.0, 3) for r in ok if r.e2e_s is not None],
    }


def ratio(num: float | None, den: float | None) -> float | None:
    """``num / den`` to 4 places; None when either is missing or ``den`` is 0."""
    return None if num is None or not den else round(num / den, 4)


def median_of_known(values: Iterable[float | None]) -> float | None:
    """The median of the values that are not None, to 4 places; None when there are none."""
    known = [v for v in values if v is not None]
    return round(statistics.median(known), 4) if known else None
