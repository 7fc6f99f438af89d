"""The one JSON report of ``scripts/gpu_check.sh``: its keys, its skeleton, and the last step that closes it.

Standard library only, on purpose: ``finalize`` must still write a report on a
device where the wheels did not install or torch does not import, so that the
run says what went wrong instead of leaving nothing behind.

The keys Step 23 (issue 40) names:

- ``decode``: one entry per flotilla measurement, each with ``shape``,
  ``batch``, ``context``, ``cuda_graphs``, ``tok_per_s`` and ``mbu`` (plus
  ``roofline_fraction``, ``step_ms`` and ``reason``);
- ``hf_peer``: the same keys for HF transformers' ``generate``;
- ``correctness``: ``attention_max_abs_diff_bf16``, ``greedy_equal_fp32``,
  ``pages_free_after_abort`` (plus the bf16 agreement, the host syncs per
  decode step, and ``reasons``);
- ``device_minutes`` and ``command``.

A figure that could not be measured is null, with the reason beside it
(``reason`` in a list entry, ``correctness.reasons[key]``): never a guess.

    python3 scripts/gpu_report.py finalize --report OUT/gpu_check.json --command "..." \\
        --elapsed-s 412 --phase setup=ok:14 --phase gpu_tests=ok:96 --junit OUT/gpu_tests.xml
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypeAlias

SCHEMA = "flotilla-gpu-check/1"
ENTRY_KEYS = ("shape", "batch", "context", "cuda_graphs", "tok_per_s", "mbu")
ENTRY_EXTRA_KEYS = ("roofline_fraction", "step_ms", "reason")
CORRECTNESS_KEYS = ("attention_max_abs_diff_bf16", "greedy_equal_fp32", "pages_free_after_abort")
CORRECTNESS_EXTRA_KEYS = ("greedy_equal_bf16_fraction", "host_syncs_per_decode_step")
TOP_KEYS = ("decode", "hf_peer", "correctness", "device_minutes", "command")
# The bench's own phases, in the order it runs them; gpu_check.sh's come before.
BENCH_PHASES = ("correctness", "decode", "hf_peer")
SHELL_PHASES = ("setup", "gpu_tests", "bench")
# A phase's status: ok, failed (it ran and something in it failed), timed_out (its time box
# ran out: what it had is kept), running (it started and never closed: the process died or was
# killed), not_run (an earlier phase stopped the run).
STATUSES = ("ok", "failed", "timed_out", "running", "not_run")

Json: TypeAlias = "None | bool | int | float | str | list[Json] | dict[str, Json]"


@dataclass(frozen=True)
class Entry:
    """One decode or HF-peer measurement; the figures are None, with ``reason``, when not measured."""

    shape: str
    batch: int
    context: int
    cuda_graphs: bool
    tok_per_s: float | None = None
    mbu: float | None = None
    roofline_fraction: float | None = None
    step_ms: float | None = None
    reason: str | None = None

    def to_json(self) -> dict[str, Json]:
        return dict(asdict(self))


def skeleton(*, dry_run: bool, command: str | None = None) -> dict[str, Json]:
    """A report with every key and nothing measured yet."""
    return {
        "schema": SCHEMA,
        "dry_run": dry_run,
        "command": command,
        "device_minutes": None,
        "device": {},
        "decode": [],
        "hf_peer": [],
        "correctness": {
            **{k: None for k in CORRECTNESS_KEYS + CORRECTNESS_EXTRA_KEYS},
            "reasons": {},
        },
        "gpu_tests": None,
        "phases": {},
        "notes": [],
        "complete": False,
    }


def write_report(path: Path, report: dict[str, Json]) -> None:
    """Write atomically: a process killed mid-write leaves the previous report, not half of one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1, allow_nan=False) + "\n")
    os.replace(tmp, path)


def read_report(path: Path, *, dry_run: bool) -> dict[str, Json]:
    """The report the bench left, or a skeleton saying it left none."""
    if not path.exists():
        report = skeleton(dry_run=dry_run)
        _notes(report).append("the bench wrote no report: every figure is missing (see the phases and their logs)")
        return report
    loaded = json.loads(path.read_text())
    if not isinstance(loaded, dict) or loaded.get("schema") != SCHEMA:
        raise ValueError(f"{path} is not a {SCHEMA} report")
    return loaded


def _notes(report: dict[str, Json]) -> list[Json]:
    notes = report["notes"]
    assert isinstance(notes, list)
    return notes


def junit_summary(path: Path) -> dict[str, Json]:
    """Counts and the failing tests' ids from pytest's ``--junitxml`` file."""
    if not path.exists():
        return {"passed": None, "failed": None, "errors": None, "skipped": None,
                "reason": f"{path.name} was not written (pytest did not finish)"}  # fmt: skip
    root = ET.parse(path).getroot()
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failing: list[Json] = []
    skipped: list[Json] = []
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        if case.find("failure") is not None:
            counts["failed"] += 1
            failing.append(name)
        elif case.find("error") is not None:
            counts["errors"] += 1
            failing.append(name)
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
            reason = case.find("skipped")
            skipped.append(f"{name}: {reason.get('message', '') if reason is not None else ''}")
        else:
            counts["passed"] += 1
    # Collection errors are <error> elements under a testcase, or counted on the suite alone.
    suite_errors = sum(int(s.get("errors", "0")) for s in root.iter("testsuite"))
    counts["errors"] = max(counts["errors"], suite_errors)
    return {**counts, "failing": failing, "skipped_ids": skipped}


def parse_phase(text: str) -> tuple[str, dict[str, Json]]:
    """``name=status:seconds`` (gpu_check.sh's record of one of its phases)."""
    name, _, rest = text.partition("=")
    status, _, seconds = rest.partition(":")
    if name not in SHELL_PHASES or status not in STATUSES or not seconds:
        raise ValueError(f"--phase wants NAME=STATUS:SECONDS with NAME in {SHELL_PHASES} "
                         f"and STATUS in {STATUSES}, got {text!r}")  # fmt: skip
    return name, {"status": status, "seconds": float(seconds)}


def problems(report: dict[str, Json]) -> list[str]:
    """What keeps the report from being complete: missing keys, nulls, failed phases, failed checks."""
    found: list[str] = []
    for key in TOP_KEYS:
        if key not in report:
            found.append(f"key {key!r} is missing")
    for key in ("decode", "hf_peer"):
        entries = report.get(key)
        if not isinstance(entries, list) or not entries:
            found.append(f"{key}: no entries")
            continue
        for entry in entries:
            assert isinstance(entry, dict)
            missing = [k for k in ENTRY_KEYS if k not in entry]
            if missing:
                found.append(f"{key} entry {entry.get('shape')} lacks {missing}")
            elif entry["tok_per_s"] is None or entry["mbu"] is None:
                found.append(f"{key} {entry['shape']} batch {entry['batch']} graphs {entry['cuda_graphs']}: "
                             f"not measured ({entry.get('reason') or 'no reason recorded'})")  # fmt: skip
    correctness = report.get("correctness")
    if not isinstance(correctness, dict):
        found.append("correctness: missing")
    else:
        reasons = correctness.get("reasons")
        assert isinstance(reasons, dict)
        for key in CORRECTNESS_KEYS:
            value = correctness.get(key)
            if value is None:
                found.append(f"correctness.{key}: not measured ({reasons.get(key) or 'the bench did not reach it'})")
            elif value is False:
                found.append(f"correctness.{key}: false")
    phases = report.get("phases")
    assert isinstance(phases, dict)
    for name in SHELL_PHASES + BENCH_PHASES:
        phase = phases.get(name)
        status = phase.get("status") if isinstance(phase, dict) else "not_run"
        if status != "ok":
            found.append(f"phase {name}: {status}")
    tests = report.get("gpu_tests")
    if isinstance(tests, dict) and (tests.get("failed") or tests.get("errors")):
        found.append(f"gpu tests: {tests.get('failed')} failed, {tests.get('errors')} errors")
    return found


def finalize(
    report_path: Path, *, dry_run: bool, command: str, elapsed_s: float,
    shell_phases: dict[str, dict[str, Json]], junit: Path | None,
) -> dict[str, Json]:  # fmt: skip
    """Close the report: the shell's phases, the gpu tests, device minutes, the command, what is missing."""
    report = read_report(report_path, dry_run=dry_run)
    phases = report["phases"]
    assert isinstance(phases, dict)
    for name, phase in phases.items():
        if isinstance(phase, dict) and phase.get("status") == "running":
            # The bench opened this phase and never closed it: killed by the shell's time box or dead.
            bench = shell_phases.get("bench", {})
            phase["status"] = "timed_out" if bench.get("status") == "timed_out" else "failed"
            _notes(report).append(f"phase {name} did not finish: the bench process ended inside it "
                                  f"(bench {bench.get('status', 'not_run')}); its figures so far are kept")  # fmt: skip
    for name in BENCH_PHASES:
        phases.setdefault(name, {"status": "not_run", "seconds": 0.0})
    phases.update(shell_phases)
    for name in SHELL_PHASES:
        phases.setdefault(name, {"status": "not_run", "seconds": 0.0})
    report["gpu_tests"] = junit_summary(junit) if junit is not None else None
    report["command"] = command
    # This script's own wall time; the machine's start and the file transfers are outside it.
    report["device_minutes"] = round(elapsed_s / 60, 2)
    found = problems(report)
    report["problems"] = list(found)
    report["complete"] = not found
    write_report(report_path, report)
    return report


def summary(report: dict[str, Json]) -> list[str]:
    """A short table of the report, for the end of the log (the device tool returns the tail)."""
    lines: list[str] = []
    phases = report["phases"]
    assert isinstance(phases, dict)
    for name in SHELL_PHASES + BENCH_PHASES:
        phase = phases.get(name)
        if isinstance(phase, dict):
            lines.append(f"  {name:<12} {phase.get('status')!s:<10} {phase.get('seconds')!s:>7} s")
    for key in ("decode", "hf_peer"):
        entries = report[key]
        assert isinstance(entries, list)
        for e in entries:
            assert isinstance(e, dict)
            lines.append(f"  {key:<8} {e.get('shape')!s:<20} batch {e.get('batch')!s:>3} graphs "
                         f"{e.get('cuda_graphs')!s:<5} tok/s {e.get('tok_per_s')!s:<10} mbu {e.get('mbu')!s:<8} "
                         f"{e.get('reason') or ''}")  # fmt: skip
    lines.append(f"  correctness {json.dumps(report['correctness'])}")
    lines.append(f"  gpu tests {json.dumps(report.get('gpu_tests'))}")
    problems_found = report.get("problems")
    if isinstance(problems_found, list):
        lines += [f"INCOMPLETE: {p}" for p in problems_found]
    lines.append(f"{'complete' if report.get('complete') else 'incomplete'}; "
                 f"device minutes {report.get('device_minutes')}; report written")  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    fin = sub.add_parser("finalize", help="close the report gpu_check.sh leaves; exit 1 unless it is complete")
    fin.add_argument("--report", type=Path, required=True)
    fin.add_argument("--command", required=True, help="the command line that ran the check")
    fin.add_argument("--elapsed-s", type=float, required=True, help="the check's wall time so far")
    fin.add_argument("--phase", action="append", default=[], help="NAME=STATUS:SECONDS, one per shell phase")
    fin.add_argument("--junit", type=Path, default=None, help="pytest's --junitxml file of the gpu tests")
    fin.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    shell_phases = dict(parse_phase(p) for p in args.phase)
    report = finalize(args.report, dry_run=args.dry_run, command=args.command, elapsed_s=args.elapsed_s,
                      shell_phases=shell_phases, junit=args.junit)  # fmt: skip
    for line in summary(report):
        print(f"[gpu_check] {line}")
    return 0 if report["complete"] else 1


if __name__ == "__main__":
    sys.exit(main())
