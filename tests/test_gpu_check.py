"""scripts/gpu_check.sh --dry-run: the device check's whole script on the CPU, and its report.

The dry run installs nothing and runs the FlashInfer emulator in place of the
kernels on tiny shapes (scripts/gpu_bench.py); it must pass and write the
report with every key Step 23 (issue 40) names, every figure measured.
``gpu_report.finalize`` is also checked on what a killed or missing bench leaves.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from scripts import gpu_report

ROOT = Path(__file__).resolve().parent.parent
DRY_RUN_LIMIT_S = 180  # the script's own box is 120 s; it takes far less on an idle machine


def test_dry_run_passes_and_writes_the_report(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable}
    start = time.monotonic()
    run = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run", str(out)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=DRY_RUN_LIMIT_S)  # fmt: skip
    elapsed = time.monotonic() - start
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["complete"] and report["problems"] == [], report["problems"]
    assert report["dry_run"] is True and report["device"]["type"] == "cpu"
    assert report["command"].startswith("bash scripts/gpu_check.sh --dry-run ")
    # The script times itself with bash's whole-second $SECONDS: up to 1 s more than this test sees.
    assert 0 < report["device_minutes"] <= (elapsed + 1) / 60 + 0.01
    for key in ("decode", "hf_peer"):
        entries = report[key]
        assert {e["shape"] for e in entries} == {"tiny-llama-3.2-1b", "tiny-llama-3-8b"}
        for e in entries:
            assert set(gpu_report.ENTRY_KEYS) <= set(e), e
            assert e["tok_per_s"] > 0 and 0 < e["mbu"] < 1 and e["reason"] is None, e
            assert e["context"] == 32
    # flotilla's decode with cuda_graphs on (static buffers, eager on the CPU) and off; HF has no such switch.
    assert sorted((e["batch"], e["cuda_graphs"]) for e in report["decode"]) == sorted(
        (b, g) for b in (1, 1, 2, 4) for g in (False, True))
    assert all(e["cuda_graphs"] is False for e in report["hf_peer"])
    correctness = report["correctness"]
    assert 0 <= correctness["attention_max_abs_diff_bf16"] <= 2e-2
    assert correctness["greedy_equal_fp32"] is True
    assert correctness["pages_free_after_abort"] is True
    # The gpu tests were collected and skipped (no CUDA here), none failed.
    tests = report["gpu_tests"]
    assert tests["skipped"] >= 1 and tests["failed"] == tests["errors"] == 0
    assert all(report["phases"][p]["status"] == "ok" for p in gpu_report.SHELL_PHASES + gpu_report.BENCH_PHASES)
    assert {f.name for f in out.iterdir()} == {"gpu_check.json", "setup.log", "gpu_tests.log", "gpu_tests.xml",
                                               "bench.log"}  # fmt: skip


def test_a_bench_killed_in_a_phase_leaves_what_it_had(tmp_path: Path) -> None:
    path = tmp_path / "gpu_check.json"
    report = gpu_report.skeleton(dry_run=False)
    report["phases"] = {"correctness": {"status": "ok", "seconds": 50.0},
                        "decode": {"status": "running", "seconds": 0.0}}  # fmt: skip
    report["decode"] = [gpu_report.Entry("llama-3.2-1b", 1, 1024, False, tok_per_s=300.0, mbu=0.5).to_json()]
    gpu_report.write_report(path, report)
    shell: dict[str, dict[str, gpu_report.Json]] = {
        "setup": {"status": "ok", "seconds": 10.0}, "gpu_tests": {"status": "ok", "seconds": 90.0},
        "bench": {"status": "timed_out", "seconds": 300.0},
    }  # fmt: skip
    returned = gpu_report.finalize(path, dry_run=False, command="bash scripts/gpu_check.sh /out", elapsed_s=420.0,
                                   shell_phases=shell, junit=None)  # fmt: skip
    closed = json.loads(path.read_text())
    assert closed == returned
    assert closed["phases"]["decode"]["status"] == "timed_out"
    assert closed["phases"]["hf_peer"]["status"] == "not_run"
    assert closed["decode"][0]["tok_per_s"] == 300.0
    assert closed["device_minutes"] == 7.0 and closed["complete"] is False
    problems = closed["problems"]
    assert "phase decode: timed_out" in problems and "hf_peer: no entries" in problems
    assert any("correctness.greedy_equal_fp32: not measured" in p for p in problems)


def test_no_bench_report_still_gives_a_report(tmp_path: Path) -> None:
    path = tmp_path / "gpu_check.json"
    shell: dict[str, dict[str, gpu_report.Json]] = {"setup": {"status": "failed", "seconds": 3.0}}
    gpu_report.finalize(path, dry_run=False, command="c", elapsed_s=3.0, shell_phases=shell, junit=None)
    closed = json.loads(path.read_text())
    assert closed["complete"] is False
    assert set(gpu_report.TOP_KEYS) <= set(closed)
    assert closed["phases"]["bench"]["status"] == "not_run"
    assert any("wrote no report" in n for n in closed["notes"])
