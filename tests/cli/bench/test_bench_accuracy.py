"""``flotilla bench accuracy``: option parsing, the KL, the teacher-forced pass, and runs on the tiny model."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from actors.engine.executor import LocalExecutor
from apps.llm import LLM
from cli.bench.accuracy import format_table
from cli.bench.accuracy.forced import kl_per_position, teacher_forced_logits
from cli.bench.accuracy.run import engine_options, run
from cli.main import main
from scheduling.errors import InvalidParameterError
from scheduling.sampling_params import SamplingParams

WORKLOAD = [
    {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 6},
    {"messages": [{"role": "user", "content": "Write a short poem about the ocean."}], "max_tokens": 6},
    {"prompt_token_ids": [5, 6, 7, 5, 6, 7, 5, 6], "max_tokens": 6},
]
SMALL = {"max_model_len": 128, "max_num_seqs": 4}
BUDGET_MIB = 8


@pytest.fixture()
def workload(tmp_path: Path) -> Path:
    path = tmp_path / "w.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in WORKLOAD))
    return path


@pytest.fixture()
def heldout(tmp_path: Path) -> Path:
    """300 bytes of prose: 300 tokens of the tiny model's byte-level tokenizer, in windows of 128."""
    path = tmp_path / "heldout.txt"
    path.write_text(("It was the best of times, it was the worst of times, it was the age of wisdom. " * 4)[:300])
    return path


@pytest.mark.parametrize(("against", "why"), [
    ("{not json", "not valid JSON"),
    ('["kv_cache_dtype", "int8"]', "must be a JSON object"),
    ('{"kv_cache_dtyp": "int8"}', r"unknown engine option\(s\) \['kv_cache_dtyp'\]"),
    ('{"dtype": "int3"}', "dtype: must be auto or one of"),
    ('{"kv_cache_dtype": "int3"}', "kv_cache_dtype: must be one of"),
    ('{"executor": "ray"}', "executor must be 'local'"),
])
def test_a_bad_against_is_an_error_naming_it(against: str, why: str) -> None:
    with pytest.raises(InvalidParameterError, match=why) as e:
        engine_options("tiny", None, against, {})
    assert e.value.param == "against"


def test_options_merge_in_order_and_a_clash_with_a_flag_is_an_error() -> None:
    base, against = engine_options("tiny", '{"max_num_seqs": 2}', {"dtype": "bfloat16"}, {"max_model_len": 64})
    assert base == {"enable_prefix_caching": False, "model": "tiny", "max_model_len": 64, "max_num_seqs": 2}
    assert against == {**base, "dtype": "bfloat16"}
    for clash in ('{"max_model_len": 32}', '{"model": "small"}'):
        with pytest.raises(InvalidParameterError, match="also given on the command line") as e:
            engine_options("tiny", clash, "{}", {"max_model_len": 64})
        assert e.value.param == "base"


def test_the_command_refuses_a_bad_against_before_loading(workload: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "accuracy", "--model", "no-such-model", "--workload", str(workload),
                 "--against", "[1]", "--no-progress"]) == 2
    assert "against: must be a JSON object" in capsys.readouterr().err
    with pytest.raises(InvalidParameterError) as e:
        run("no-such-model", workload, against="{}", kv_budget_mib=0)
    assert e.value.param == "kv_budget_mib"


def test_kl_is_zero_for_equal_logits_and_matches_the_formula() -> None:
    logits = torch.randn(5, 11, generator=torch.Generator().manual_seed(0)) * 4
    assert torch.equal(kl_per_position(logits, logits.clone()), torch.zeros(5, dtype=torch.float64))
    p, q = [0.5, 0.5], [0.9, 0.1]
    expected = sum(a * math.log(a / b) for a, b in zip(p, q, strict=True))
    got = kl_per_position(torch.tensor([p]).log(), torch.tensor([q]).log() + 3.0)  # a shift changes nothing
    assert got.dtype == torch.float64 and got.item() == pytest.approx(expected, rel=1e-6)
    with pytest.raises(InvalidParameterError) as e:
        kl_per_position(logits, logits[:, :10])
    assert e.value.param == "against"


def test_teacher_forced_logits_predict_the_greedy_output(tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), **SMALL)
    try:
        prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]  # past one 16-token page
        [out] = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                             use_tqdm=False)
        output = list(out.outputs[0].token_ids)
        executor = llm.engine.executor
        assert isinstance(executor, LocalExecutor)
        logits = teacher_forced_logits(executor.runner, prompt, output)
    finally:
        llm.shutdown()
    assert logits.shape == (12, llm.engine.vocab_size) and logits.dtype == torch.float32
    assert logits.argmax(dim=-1).tolist() == output


def test_an_identical_config_agrees_exactly(tiny_model_dir: Path, workload: Path, heldout: Path) -> None:
    # dtype auto is float32 on the CPU: the against engine is the base one, built again.
    out = run(str(tiny_model_dir), workload, against={"dtype": "float32"}, base={"max_num_seqs": 2},
              kv_budget_mib=BUDGET_MIB, batch1_tokens=4, max_model_len=128, heldout=heldout)
    assert out["greedy_agreement"] == 1.0
    assert out["mean_kl"] == 0.0 and out["max_kl"] == 0.0
    # The token-level figures of a config against itself; held-out windows of max_model_len (128, 128, 44).
    assert out["token_top1_agreement"] == 1.0 and out["perplexity_ratio"] == 1.0
    assert out["token_top1_matches"] == out["output_tokens"]
    assert (out["heldout"]["window"], out["heldout"]["tokens"]) == (128, 300 - 3)
    assert out["heldout"]["base_perplexity"] == out["heldout"]["against_perplexity"] > 1.0
    assert out["heldout"]["top1_agreement"] == 1.0
    assert out["kv_pages_ratio"] == 1.0
    assert out["base"]["kv_bytes_per_page"] == out["against"]["kv_bytes_per_page"]
    assert out["against_config"] == {**out["base_config"], "dtype": "float32"}
    assert out["base_config"]["max_num_seqs"] == 2


def test_bfloat16_against_float32_from_the_command_line(tiny_model_dir: Path, workload: Path, heldout: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "accuracy", "--model", str(tiny_model_dir), "--workload", str(workload),
                 "--against", '{"dtype": "bfloat16"}', "--base", '{"dtype": "float32"}', "--max-model-len", "128",
                 "--max-num-seqs", "4", "--kv-budget-mib", str(BUDGET_MIB), "--batch1-tokens", "4",
                 "--heldout", str(heldout), "--no-progress", "--json"]) == 0
    out: dict[str, Any] = json.loads(capsys.readouterr().out)
    base, against = out["base"], out["against"]
    assert (out["requests"], out["kv_budget_mib"]) == (3, BUDGET_MIB)
    assert out["output_tokens"] == base["output_tokens"] >= 6  # the id line ignores EOS
    assert out["prompt_tokens"] > 8
    assert 0.0 < out["mean_kl"] <= out["max_kl"] < 0.1  # bf16 rounding: small, never zero
    assert out["perplexity_ratio"] != 1.0 and 0.0 <= out["token_top1_agreement"] <= 1.0
    assert 0.0 <= out["greedy_agreement"] <= 1.0
    # float32 pages are twice bfloat16's; both counted in the same fixed budget.
    assert base["kv_bytes_per_page"] == 2 * against["kv_bytes_per_page"]
    for side in (base, against):
        assert side["kv_pages"] == BUDGET_MIB * 2**20 // side["kv_bytes_per_page"]
        assert side["output_tok_per_s"] > 0 and side["decode_tok_per_s"] > 0
    assert out["kv_pages_ratio"] == 2.0
    assert base["weight_bytes"] == 2 * against["weight_bytes"] > 0
    assert out["decode_speedup"] == round(against["decode_tok_per_s"] / base["decode_tok_per_s"], 4)
    assert 'against {"dtype": "bfloat16"}' in format_table(out)
