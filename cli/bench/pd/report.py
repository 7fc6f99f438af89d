"""``flotilla bench pd``'s figures: one object per mode, the KV-transfer figures, and the ratios.

Latencies come from ``cli.bench.stats.summarize`` (the benchmarks'
statistics over ``stream_client``'s TTFT and TPOT, as ``bench serve`` reports them): TPOT of the
decode streams only (the long prompts' few tokens are not the steady
decode), TTFT of every request and of the long prompts apart, goodput over
every request (``_meets``: a failed request never counts).
"""

from __future__ import annotations

from typing import Any

from cli.bench.metrics import histogram_quantile
from cli.bench.pd.bandwidth import Bandwidth
from cli.bench.pd.figures import PDFigures
from cli.bench.pd.workload import WorkloadResult
from cli.bench.stats import parse_slo, summarize
from scheduling.errors import InvalidParameterError


def parse_pd_slo(items: list[str]) -> dict[str, float]:
    """SLOs as ``bench serve`` takes them (``ttft:2000 tpot:100``) or as ``ttft_ms=2000,tpot_ms=100``."""
    pairs: list[str] = []
    for item in items:
        for part in filter(None, (p.strip() for p in item.split(","))):
            if "=" in part:
                name, _, value = part.partition("=")
                part = f"{name.strip().removesuffix('_ms')}:{value.strip()}"
            pairs.append(part)
    slo = parse_slo(pairs)
    if not slo:
        raise InvalidParameterError("slo", "give at least one SLO, e.g. ttft:2000 tpot:100")
    return slo


def mode_report(result: WorkloadResult, slo: dict[str, float]) -> dict[str, Any]:
    """The figures of one mode's run."""
    everything = summarize(result.short + result.long, result.duration_s, slo)
    streams = summarize(result.short, result.duration_s, {})
    longs = summarize(result.long, result.duration_s, {})
    goodput = everything["goodput"]
    return {
        "requests": len(result.short) + len(result.long),
        "long_requests": len(result.long),
        "failed": everything["failed_requests"],
        "errors": everything["errors"],
        "duration_s": everything["duration_s"],
        "tpot_p50_ms": streams["tpot_ms"]["p50"],
        "tpot_p95_ms": streams["tpot_ms"]["p95"],
        "ttft_p50_ms": everything["ttft_ms"]["p50"],
        "ttft_p95_ms": everything["ttft_ms"]["p95"],
        "stream_ttft_p95_ms": streams["ttft_ms"]["p95"],
        "long_ttft_p50_ms": longs["ttft_ms"]["p50"],
        "long_ttft_p95_ms": longs["ttft_ms"]["p95"],
        "goodput": goodput["request_throughput"],
        "goodput_fraction": goodput["fraction"],
        "good_requests": goodput["good_requests"],
        "output_tok_per_s": everything["output_throughput"],
    }


def transfer_report(moved: PDFigures, long_tokens: int, bandwidth: Bandwidth | None) -> dict[str, Any]:
    """KV-transfer figures of a disaggregated run from its ``/metrics`` change, beside one hop's arithmetic.

    Every remote prefill is a long prompt (short prompts stay under
    ``remote_prefill_min_tokens``, which ``bench pd`` checks), so bytes per
    token is the bytes moved over ``remote_prefills * long_tokens``; the
    expected time is those bytes per token x ``long_tokens`` / ``bandwidth``.
    """
    p50 = histogram_quantile(0.50, moved.transfer_buckets)
    p95 = histogram_quantile(0.95, moved.transfer_buckets)
    per_token = moved.kv_bytes / (moved.remote_prefills * long_tokens) if moved.remote_prefills > 0 else None
    expected = bandwidth.transfer_ms(per_token * long_tokens) if bandwidth and per_token is not None else None
    return {
        "remote_prefills": int(moved.remote_prefills),
        "prefill_retries": int(moved.prefill_retries),
        "kv_bytes_total": int(moved.kv_bytes),
        "kv_bytes_per_token": None if per_token is None else round(per_token, 1),
        "kv_transfer_ms_p50": None if p50 is None else round(p50 * 1e3, 3),
        "kv_transfer_ms_p95": None if p95 is None else round(p95 * 1e3, 3),
        "kv_transfer_ms_mean": (round(moved.transfer_sum_s * 1e3 / moved.transfer_count, 3)
                                if moved.transfer_count > 0 else None),
        "bandwidth_gb_s": None if bandwidth is None else round(bandwidth.bytes_per_s / 1e9, 3),
        "expected_transfer_ms": None if expected is None else round(expected, 3),
    }
