"""What ``flotilla simulate`` prints (one JSON object) and draws (a PNG timeline)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cli.bench.stats import summarize
from cli.simulate.fleet import FleetRun


def report(run: FleetRun, *, slo_ms: dict[str, float], wall_s: float, profile: dict[str, object],
           policy: str) -> dict[str, Any]:
    """The issue's keys first (``requests`` ... ``wall_s``), then the rest of the run's figures.

    Latencies and goodput come from ``cli.bench.stats.summarize`` over the
    simulated requests, the same arithmetic as ``bench serve``'s; goodput is
    requests meeting every SLO per second of the run.
    """
    s = summarize(run.results, run.duration_s, slo_ms)
    goodput = s["goodput"]
    return {
        "requests": len(run.results) + run.rejected + run.unfinished,
        "ttft_p50_ms": s["ttft_ms"]["p50"],
        "ttft_p95_ms": s["ttft_ms"]["p95"],
        "tpot_p95_ms": s["tpot_ms"]["p95"],
        "goodput_req_per_s": goodput["request_throughput"] if goodput else None,
        "replica_seconds": round(run.replica_seconds, 1),
        "max_replicas": run.max_replicas,
        "scale_events": [{"t": e.t, "pool": e.pool, "replicas": e.replicas, "reason": e.reason}
                         for e in run.scale_events],
        "wall_s": round(wall_s, 2),
        "policy": policy,
        "finished": len(run.results),
        "rejected_max_model_len": run.rejected,
        "unfinished": run.unfinished,
        "gave_up": run.gave_up,
        "duration_s": round(run.duration_s, 3),
        "settled_s": round(run.settled_s, 3),
        "slo_ms": slo_ms,
        "goodput_fraction": goodput["fraction"] if goodput else None,
        "ttft_ms": s["ttft_ms"],
        "tpot_ms": s["tpot_ms"],
        "e2e_ms": s["e2e_ms"],
        "output_tok_per_s": s["output_throughput"],
        "kv_usage_peak": round(run.kv_peak, 4),
        "kv_handoffs": run.handoffs,
        "steps": run.steps,
        "profile": profile,
    }


def plot(run: FleetRun, path: Path, *, slo_ms: dict[str, float]) -> Path:
    """Replicas and open requests over time; each request's TTFT at its arrival, against the SLO."""
    # Imported here: matplotlib is slow to import and only this call needs it; the backend must be
    # chosen before pyplot loads.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True)
    t = [p[0] for p in run.timeline]
    top.step(t, [p[1] for p in run.timeline], where="post", color="tab:blue", label="replicas asked for")
    top.set_ylabel("replicas")
    other = top.twinx()
    other.plot(t, [p[2] for p in run.timeline], color="gray", linewidth=0.8, label="open requests")
    other.set_ylabel("open requests")
    top.legend(loc="upper left", fontsize=8)
    other.legend(loc="upper right", fontsize=8)
    bottom.plot([r.start_s for r in run.results], [(r.ttft_s or 0) * 1e3 for r in run.results], ".",
                markersize=2, label="TTFT (ms)")
    if "ttft" in slo_ms:
        bottom.axhline(slo_ms["ttft"], color="red", linestyle="--", label="TTFT SLO")
    bottom.set_yscale("log")
    bottom.set_xlabel("simulated seconds")
    bottom.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

