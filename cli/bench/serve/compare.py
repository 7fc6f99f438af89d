"""``flotilla bench serve --compare``: two results side by side, and whether the new one regressed.

A row regresses when a gating figure (throughput, TPOT P95) is worse than the
base's by more than the threshold (relative); the command then exits 1.
"""

from __future__ import annotations

from typing import Any

# (label, path into a run, higher is better, gates the exit code)
COMPARED: tuple[tuple[str, tuple[str, ...], bool, bool], ...] = (
    ("request_throughput", ("request_throughput",), True, True),
    ("output_throughput", ("output_throughput",), True, True),
    ("ttft_p50_ms", ("ttft_ms", "p50"), False, False),
    ("ttft_p95_ms", ("ttft_ms", "p95"), False, False),
    ("tpot_p50_ms", ("tpot_ms", "p50"), False, False),
    ("tpot_p95_ms", ("tpot_ms", "p95"), False, True),
    ("itl_p50_ms", ("itl_ms", "p50"), False, False),
    ("itl_p90_ms", ("itl_ms", "p90"), False, False),
    ("e2e_p95_ms", ("e2e_ms", "p95"), False, False),
)


def _get(run: dict[str, Any], path: tuple[str, ...]) -> float | None:
    node: Any = run
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return float(node) if isinstance(node, (int, float)) else None


def compare(base: dict[str, Any], new: dict[str, Any], threshold: float = 0.05) -> tuple[list[dict[str, Any]], bool]:
    """Rows comparing each run of ``new`` with the run of ``base`` at the same position.

    A row regresses when a gating figure is worse by more than ``threshold``
    (relative); returns the rows and whether any regressed.
    """
    rows: list[dict[str, Any]] = []
    regressed = False
    for i, (b, n) in enumerate(zip(base.get("runs", []), new.get("runs", []), strict=False)):
        for label, path, higher_better, gates in COMPARED:
            bv, nv = _get(b, path), _get(n, path)
            change = None if bv is None or nv is None or bv == 0 else (nv - bv) / bv
            worse = change is not None and (-change if higher_better else change) > threshold
            bad = bool(worse and gates)
            regressed |= bad
            rows.append({"run": i, "request_rate": n.get("request_rate"), "metric": label, "base": bv, "new": nv,
                         "change": None if change is None else round(change, 4), "regressed": bad})
    return rows, regressed


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def format_table(rows: list[dict[str, Any]]) -> str:
    """A plain-text table of ``compare`` rows."""
    fmt = _fmt
    lines = [f"{'run':>3} {'rate':>7} {'metric':<20} {'base':>12} {'new':>12} {'change':>8}"]
    for r in rows:
        change = "-" if r["change"] is None else f"{r['change'] * 100:+.1f}%"
        flag = "  REGRESSED" if r["regressed"] else ""
        lines.append(f"{r['run']:>3} {str(r['request_rate']):>7} {r['metric']:<20} {fmt(r['base']):>12} "
                     f"{fmt(r['new']):>12} {change:>8}{flag}")
    return "\n".join(lines)
