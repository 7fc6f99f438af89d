"""``flotilla bench offline``: the workload's throughput, then a lone request's prefill and decode speed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli.main import main


def test_bench_offline_reports_the_workload_and_batch1(tmp_path: Path, tiny_model_dir: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    workload = tmp_path / "w.jsonl"
    reqs = [{"prompt_token_ids": [5 + i, 6, 7], "max_tokens": 3 + i} for i in range(4)]
    workload.write_text("".join(json.dumps(r) + "\n" for r in reqs))
    assert main(["bench", "offline", "--model", str(tiny_model_dir), "--workload", str(workload),
                 "--max-model-len", "256", "--batch1-prompt-len", "10", "--batch1-tokens", "6"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["requests"] == 4 and out["output_tokens"] == sum(r["max_tokens"] for r in reqs)
    # Four requests batched together: one step per token of the longest, and each step ran a forward.
    assert out["engine_steps"] == max(r["max_tokens"] for r in reqs)
    assert 0 < out["engine_forward_ms_per_step"] * out["engine_steps"] < out["seconds"] * 1e3
    b1 = out["batch1"]
    assert (b1["prompt_tokens"], b1["output_tokens"], b1["runs"]) == (10, 6, 3)
    assert b1["prefill_tok_per_s"] > 0 and b1["decode_tok_per_s"] > 0


def test_batch1_can_be_skipped(tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    workload = tmp_path / "w.jsonl"
    workload.write_text(json.dumps({"prompt_token_ids": [5, 6], "max_tokens": 2}) + "\n")
    assert main(["bench", "offline", "--model", str(tiny_model_dir), "--workload", str(workload),
                 "--max-model-len", "256", "--batch1-tokens", "0"]) == 0
    assert "batch1" not in json.loads(capsys.readouterr().out)
