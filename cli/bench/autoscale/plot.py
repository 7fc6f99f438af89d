"""The PNG timeline of ``flotilla bench autoscale``: load and replicas, queue, latency vs SLO."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_timeline(runs: dict[str, list[dict[str, Any]]], path: str | Path, *, slo_ttft_ms: float,
                  slo_tpot_ms: float) -> Path:
    """One column of three panels per run (``label -> samples``); returns ``path``."""
    # Imported here: matplotlib is slow to import (docs/benchmarks.md) and only this call needs it; the
    # backend must be chosen before pyplot loads.
    import matplotlib

    matplotlib.use("Agg")  # no display: write the file only
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, len(runs), figsize=(6.5 * len(runs), 8), sharex=True, squeeze=False)
    for col, (label, samples) in enumerate(runs.items()):
        t = [s["t"] for s in samples]
        ax = axes[0][col]
        ax.plot(t, [s["offered_rps"] for s in samples], color="gray", label="offered req/s")
        ax.plot(t, [s["good"] for s in samples], color="green", label="good req/s")
        ax2 = ax.twinx()
        ax2.step(t, [s["replicas"] or 0 for s in samples], where="post", color="tab:blue", label="replicas")
        ax2.set_ylabel("replicas")
        ax.set_title(label)
        ax.legend(loc="upper left", fontsize=8)
        ax2.legend(loc="upper right", fontsize=8)
        ax = axes[1][col]
        ax.plot(t, [s["in_flight"] for s in samples], label="in flight")
        ax.plot(t, [s["queued"] for s in samples], label="queued (no first token)")
        ax.legend(loc="upper left", fontsize=8)
        ax = axes[2][col]
        ax.plot(t, [s["ttft_p95_ms"] for s in samples], ".", label="TTFT P95 (ms)")
        ax.axhline(slo_ttft_ms, color="red", linestyle="--", label="TTFT SLO")
        ax.plot(t, [s["tpot_p95_ms"] for s in samples], ".", label="TPOT P95 (ms)")
        ax.axhline(slo_tpot_ms, color="orange", linestyle="--", label="TPOT SLO")
        ax.set_yscale("log")
        ax.set_xlabel("s")
        ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out
