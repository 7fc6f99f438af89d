"""``flotilla plan``: the issue's worked examples, config.json input, JSON output, errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cli.main import main
from cli.plan.hardware import MODELS, get_model, load_hf_config
from cli.plan.planner import (
    bytes_for,
    cost_per_million_tokens,
    count_params,
    kv_bytes_per_token,
    plan,
)
from kvcache.kv_pool import KVPool
from scheduling.errors import InvalidParameterError

GIB = 2**30
A100_80G = 80 * 10**9

# meta-llama/Llama-2-7b-hf's config.json, trimmed to what matters plus some noise.
LLAMA2_7B_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 32, "vocab_size": 32000,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-05, "tie_word_embeddings": False,
    "torch_dtype": "float16", "rope_scaling": None,
}


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """main(argv) -> (exit code, stdout, stderr); argparse's own errors raise SystemExit."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


# The worked examples.

def test_llama2_7b_params_and_fp16_weights() -> None:
    n = count_params(get_model("llama-2-7b")).total
    assert n == 6_738_415_616  # the published 6.74B
    assert bytes_for(n, "fp16") / 1e9 == pytest.approx(13.5, rel=0.02)
    assert bytes_for(n, "int8") * 2 == bytes_for(n, "fp16") == bytes_for(n, "int4") * 4


def test_llama2_7b_kv_cache() -> None:
    per_token = kv_bytes_per_token(get_model("llama-2-7b"), "fp16")
    assert per_token == 2 * 32 * 32 * 128 * 2
    assert per_token * 2048 * 1 / 1e9 == pytest.approx(1.07, abs=0.01)
    assert per_token * 4096 * 16 == 32 * GIB


def test_70b_fp16_needs_tp4_on_a100_80g() -> None:
    report = plan(get_model("llama-2-70b"), gpu_name="A100-80G", gpu_memory_bytes=A100_80G,
                  dtype="fp16", context=4096, batch=8)
    assert report.weight_bytes / 1e9 == pytest.approx(140, rel=0.03)
    two_cards = 2 * A100_80G * 0.9  # 144 GB usable: the weights fit, weights + KV do not
    assert report.weight_bytes < two_cards < report.weight_bytes + report.kv_bytes
    assert [f.fits for f in report.fits] == [False, False, True, True]
    assert report.tp == 4


def test_70b_int4_fits_one_80g_card() -> None:
    report = plan(get_model("llama-2-70b"), gpu_name="A100-80G", gpu_memory_bytes=A100_80G,
                  dtype="int4", context=4096, batch=8)
    assert report.weight_bytes / 1e9 == pytest.approx(35, rel=0.03)
    assert report.kv_dtype == "fp16"  # quantized weights keep an fp16 KV
    assert report.tp == 1


def test_cost_per_million_tokens() -> None:
    assert cost_per_million_tokens(10, 1, 1000) == pytest.approx(2.78, abs=0.005)
    assert cost_per_million_tokens(10, 4, 1000) == pytest.approx(4 * 2.7778, rel=1e-4)


# Presets, KV dtype rule and per-TP capacity.

@pytest.mark.parametrize(("name", "billions"), [
    ("llama-2-7b", 6.74), ("llama-2-13b", 13.02), ("llama-2-70b", 68.98), ("llama-3-8b", 8.03),
    ("llama-3-70b", 70.55), ("qwen2-7b", 7.62), ("mistral-7b", 7.24)])
def test_preset_param_counts_match_published(name: str, billions: float) -> None:
    assert count_params(MODELS[name]).total / 1e9 == pytest.approx(billions, abs=0.01)


def test_kv_dtype_defaults_and_override() -> None:
    def kv_of(dtype: str, kv_dtype: str | None = None) -> tuple[str, int]:
        report = plan(get_model("llama-3-8b"), gpu_name="H100", gpu_memory_bytes=A100_80G,
                      dtype=dtype, kv_dtype=kv_dtype)
        return report.kv_dtype, report.kv_bytes_per_token

    per_elem = 2 * 32 * 8 * 128  # K and V, layers, KV heads, head_dim
    assert kv_of("bf16") == ("bf16", per_elem * 2)
    assert kv_of("fp32") == ("fp32", per_elem * 4)
    assert kv_of("int8") == kv_of("int4") == ("fp16", per_elem * 2)
    scales = 2 * 32 * 8 * 2  # K and V, layers, KV heads, one bf16 scale
    assert kv_of("int4", "int8") == ("int8", per_elem + scales)
    assert kv_of("bf16", "fp8") == ("fp8", per_elem + scales)
    with pytest.raises(InvalidParameterError) as err:
        kv_of("bf16", "int4")  # the engine has no int4 KV cache
    assert err.value.param == "kv_dtype"


@pytest.mark.parametrize(("plan_name", "engine_name"), [("fp32", "auto"), ("int8", "int8"), ("fp8", "fp8")])
def test_kv_bytes_match_what_the_engine_allocates(plan_name: str, engine_name: str) -> None:
    model = get_model("llama-3-8b")
    pool = KVPool(num_layers=model.num_layers, num_pages=2, page_size=4, num_kv_heads=model.num_kv_heads,
                  head_dim=model.head_dim, dtype=torch.float32, kv_dtype=engine_name)
    tensors = [*pool.k_caches, *pool.v_caches, *(pool.k_scales or []), *(pool.v_scales or [])]
    allocated = sum(t.numel() * t.element_size() for t in tensors)
    assert allocated == pool.total_bytes
    assert kv_bytes_per_token(model, plan_name) == allocated // pool.num_tokens


def test_max_num_seqs_per_tp() -> None:
    report = plan(get_model("llama-2-7b"), gpu_name="A100-80G", gpu_memory_bytes=A100_80G,
                  context=2048, memory_fraction=0.9)
    spare = 72 * 10**9 - report.weight_bytes
    assert report.fits[0].max_num_seqs == spare // (524288 * 2048)
    assert [f.tp for f in report.fits] == [1, 2, 4, 8]
    assert all(a.max_num_seqs < b.max_num_seqs for a, b in zip(report.fits, report.fits[1:], strict=False))


# The command.

def test_cli_text_report(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(["plan", "--preset", "llama-2-7b", "--gpu", "A100-80G", "--context",
                              "2048", "--price-per-hour", "10", "--throughput", "1000"], capsys)
    assert code == 0, err
    assert "6.74 B" in out and "13.48 GB / 12.55 GiB" in out
    assert "1.07 GB / 1.00 GiB" in out
    assert "smallest TP: 1" in out and "2.78 per 1M output tokens" in out


def test_cli_without_a_gpu_prints_weights_and_kv_but_no_fit_table(
        capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(["plan", "--preset", "llama-2-7b", "--context", "2048"], capsys)
    assert code == 0, err
    assert "13.48 GB / 12.55 GiB" in out and "1.07 GB / 1.00 GiB" in out
    assert "no fit table" in out
    assert "smallest TP" not in out and "DOES NOT FIT" not in out and "usable" not in out
    code, out, err = run_cli(["plan", "--preset", "llama-2-7b", "--context", "2048", "--json"], capsys)
    assert code == 0, err
    data = json.loads(out)
    assert (data["fits"], data["tp"], data["gpu_name"], data["gpu_memory_bytes"]) == ([], None, None, None)
    assert data["kv_bytes"] == 524288 * 2048


def test_cli_cost_without_a_gpu_needs_the_tp_degree(capsys: pytest.CaptureFixture[str]) -> None:
    priced = ["plan", "--preset", "llama-2-7b", "--price-per-hour", "10", "--throughput", "1000"]
    code, _, err = run_cli(priced, capsys)
    assert code == 2 and "--price-per-hour" in err and "--tp" in err and "Traceback" not in err
    code, out, err = run_cli([*priced, "--tp", "2", "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["cost"]["num_gpus"] == 2


def test_cli_says_when_even_tp8_does_not_fit(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(["plan", "--preset", "llama-2-70b", "--gpu", "L4", "--context", "4096",
                            "--batch", "64"], capsys)
    assert code == 0
    assert "DOES NOT FIT even on 8 x L4" in out


def test_cli_json_with_hf_config_and_bench_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA2_7B_CONFIG))
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"requests": 100, "output_tok_per_s": 1000.0, "seconds": 12.5}))
    code, out, err = run_cli(["plan", "--config", str(config), "--gpu-memory-gb", "80",
                              "--context", "4096", "--batch", "16", "--price-per-hour", "10",
                              "--bench-json", str(bench), "--json"], capsys)
    assert code == 0, err
    data = json.loads(out)
    assert data["num_params"] == count_params(get_model("llama-2-7b")).total
    assert data["kv_bytes"] == 32 * GIB
    assert data["tp"] == 1 and data["cost"]["num_gpus"] == 1
    assert data["cost"]["cost_per_million_tokens"] == pytest.approx(2.78, abs=0.005)
    assert len(data["fits"]) == 4


def test_hf_config_defaults_gqa_and_tied(tmp_path: Path) -> None:
    cfg = {"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864,
           "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
           "vocab_size": 151936, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    model = load_hf_config(tmp_path)  # a model folder works too
    assert (model.head_dim, model.tie_word_embeddings, model.attention_bias) == (64, True, True)
    assert count_params(model).lm_head == 0
    assert count_params(model).total / 1e9 == pytest.approx(0.494, abs=0.001)  # Qwen2-0.5B


def test_planner_imports_neither_torch_nor_ray() -> None:
    code = ("import sys, cli.main, cli.plan.cli; "
            "bad = {'torch', 'ray', 'transformers'} & set(sys.modules); assert not bad, bad")
    root = Path(__file__).resolve().parents[3]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)


# Errors: exit 2, the flag named, no traceback.

@pytest.mark.parametrize(("argv", "flag"), [
    (["--preset", "llama-9"], "--preset"),
    (["--gpu", "TPU-v5"], "--gpu"),
    (["--gpu-memory-gb", "-80"], "--gpu-memory-gb"),
    (["--context", "-1"], "--context"),
    (["--batch", "0"], "--batch"),
    (["--memory-fraction", "1.5"], "--memory-fraction"),
    (["--dtype", "int3"], "--dtype"),
    (["--context", "many"], "--context"),
    (["--price-per-hour", "-1", "--throughput", "1000"], "--price-per-hour"),
    (["--price-per-hour", "10", "--throughput", "-5"], "--throughput"),
    (["--price-per-hour", "10"], "--price-per-hour"),
    (["--throughput", "1000"], "--throughput"),
    (["--tp", "3"], "--tp"),
])
def test_cli_errors_name_the_flag(argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    base = {"--preset": "llama-2-7b", "--gpu": "A100-80G"}
    if "--gpu-memory-gb" in argv:
        base.pop("--gpu")
    for key in list(base):
        if key in argv:
            base.pop(key)
    full = ["plan", *argv, *(x for kv in base.items() for x in kv)]
    code, _, err = run_cli(full, capsys)
    assert code == 2
    assert flag in err and "Traceback" not in err


def test_cli_file_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    gpu = ["--gpu", "H100"]
    code, _, err = run_cli(["plan", "--config", str(tmp_path / "nope.json"), *gpu], capsys)
    assert code == 2 and "--config" in err and "nope.json" in err
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps({"hidden_size": 4096, "num_attention_heads": 32}))
    code, _, err = run_cli(["plan", "--config", str(partial), *gpu], capsys)
    assert code == 2 and "--config" in err and "num_hidden_layers" in err
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    code, _, err = run_cli(["plan", "--config", str(broken), *gpu], capsys)
    assert code == 2 and "--config" in err
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"seconds": 3}))
    code, _, err = run_cli(["plan", "--preset", "mistral-7b", *gpu, "--price-per-hour", "3",
                            "--bench-json", str(bench)], capsys)
    assert code == 2 and "--bench-json" in err and "output_tok_per_s" in err
