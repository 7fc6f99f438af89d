"""The PNG of a ``flotilla bench serve`` result: latency against throughput, and latency CDFs.

Left: TTFT and TPOT P50/P95 against the achieved request throughput of each
run (one point per rate of a sweep). Middle and right: the CDFs of each run's
per-request TTFT and TPOT. Needs matplotlib (the ``bench`` extra).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot(result: dict[str, Any], path: str | Path) -> Path:
    """Write the figure for ``result`` to ``path``; returns the path."""
    # Imported here: matplotlib is slow to import (docs/benchmarks.md) and only this call needs it; the
    # backend must be chosen before pyplot loads.
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    runs = result["runs"]
    fig, (ax_rate, ax_ttft, ax_tpot) = plt.subplots(1, 3, figsize=(16, 4.5))
    xs = [r["request_throughput"] for r in runs]
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT")):
        for q, style in (("p50", "-o"), ("p95", "--o")):
            ys = [r[key][q] if r[key][q] is not None else float("nan") for r in runs]
            ax_rate.plot(xs, ys, style, label=f"{name} {q.upper()}")
    ax_rate.set(xlabel="achieved requests / s", ylabel="ms", title="latency vs load", yscale="log")
    ax_rate.legend()
    for ax, key, title in ((ax_ttft, "ttft_ms", "TTFT CDF"), (ax_tpot, "tpot_ms", "TPOT CDF")):
        for r in runs:
            values = sorted(r.get("samples", {}).get(key, []))
            if values:
                ys = [(i + 1) / len(values) for i in range(len(values))]
                ax.step(values, ys, where="post", label=f"rate {r['request_rate']}")
        ax.set(xlabel="ms", ylabel="fraction of requests", title=title)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    ax_rate.grid(alpha=0.3)
    fig.suptitle(f"{result.get('server', '?')} {result.get('model', '')} at {result.get('base_url', '')}")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
