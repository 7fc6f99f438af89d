"""The result of ``flotilla bench structured validity``: counts per temperature and kind, failures, a table."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from cli.bench.stats import median_of_known
from cli.bench.structured.probes import KINDS, Reply

FAILURE_TEXT_CHARS = 400  # of a failed reply's raw text, in the report


def summarize(replies: list[Reply]) -> dict[str, Any]:
    """Counts, finish reasons and medians of one kind at one temperature."""
    answered = [r for r in replies if r.answered]
    return {
        "requests": len(replies),
        "parsed": sum(r.parsed for r in replies),
        "valid": sum(r.valid for r in replies),
        "errors": len(replies) - len(answered),
        "finish_reasons": dict(Counter(r.finish_reason for r in answered)),
        "latency_median_s": median_of_known([r.latency_s for r in answered]),
        "completion_tokens_median": median_of_known(r.completion_tokens for r in answered),
    }


def failure(reply: Reply) -> dict[str, Any]:
    """One invalid reply for the report, its raw text cut to ``FAILURE_TEXT_CHARS``."""
    p = reply.probe
    text = reply.text if reply.text is None or len(reply.text) <= FAILURE_TEXT_CHARS else (
        reply.text[:FAILURE_TEXT_CHARS] + f"... ({len(reply.text)} chars)")
    return {"schema": p.case.name, "kind": p.kind, "temperature": p.temperature, "sample": p.sample,
            "finish_reason": reply.finish_reason, "error": reply.error, "text": text}


def format_table(result: dict[str, Any]) -> str:
    """A short table for a person (``--json`` prints the whole result instead)."""
    r = result
    lines = [
        f"{r['model']} at {r['base_url']}: {r['schemas']} schemas ({r['schema_set']}), {r['samples']} samples each "
        f"+ 1 forced tool call, max_tokens {r['max_tokens']}, {r['seconds']:.1f} s",
        f"{'temp':>6} {'kind':12}{'requests':>9}{'parsed':>8}{'valid':>7}{'errors':>7}{'median s':>10}"
        f"{'med tok':>9}  finish reasons",
    ]
    for row in r["by_temperature"]:
        for kind in KINDS:
            s = row[kind]
            lat = "-" if s["latency_median_s"] is None else f"{s['latency_median_s']:.2f}"
            tok = "-" if s["completion_tokens_median"] is None else f"{s['completion_tokens_median']:.0f}"
            lines.append(f"{row['temperature']:>6} {kind:12}{s['requests']:>9}{s['parsed']:>8}{s['valid']:>7}"
                         f"{s['errors']:>7}{lat:>10}{tok:>9}  {json.dumps(s['finish_reasons'])}")
    lines.append(f"all_valid {r['all_valid']}: {r['valid']} of {r['requests']} replies valid")
    for f in r["failures"][:10]:
        lines.append(f"  FAIL {f['schema']} {f['kind']} t={f['temperature']} #{f['sample']} "
                     f"({f['finish_reason']}): {f['error']}\n       {f['text']!r}")
    if len(r["failures"]) > 10:
        lines.append(f"  ... {len(r['failures']) - 10} more failures (--json lists them all)")
    return "\n".join(lines)
