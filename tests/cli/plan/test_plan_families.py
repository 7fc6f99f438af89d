"""``flotilla plan`` for Qwen3, Gemma 3, Phi-3 and mixtures of experts: parameter counts, expert
traffic, sliding-window KV arithmetic, config.json parsing and the new ``--json`` keys."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from cli.plan.hardware import MODELS, ModelArch, get_model, model_from_hf_config, windowed_layers
from cli.plan.planner import (
    bytes_for,
    count_params,
    decode_bytes_per_step,
    expected_experts_touched,
    expert_params,
    kv_bytes_per_sequence_window_aware,
    kv_bytes_per_token,
    plan,
)
from scheduling.errors import InvalidParameterError
from tests.cli.plan.test_planner import run_cli

# config.json of each family as published on the Hugging Face hub, trimmed to what the planner reads
# plus some noise (rope, eps, flags it must ignore).
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
    "head_dim": 128, "hidden_size": 4096, "intermediate_size": 12288, "max_position_embeddings": 40960,
    "max_window_layers": 36, "num_attention_heads": 32, "num_hidden_layers": 36,
    "num_key_value_heads": 8, "rope_theta": 1000000, "sliding_window": None,
    "tie_word_embeddings": False, "use_sliding_window": False, "vocab_size": 151936,
}
# google/gemma-3-27b-it: the language model under text_config, which leaves vocab_size,
# tie_word_embeddings and the window pattern to Gemma3TextConfig's defaults.
GEMMA3_27B_TEXT = {
    "head_dim": 128, "hidden_size": 5376, "intermediate_size": 21504, "model_type": "gemma3_text",
    "num_attention_heads": 32, "num_hidden_layers": 62, "num_key_value_heads": 16,
    "query_pre_attn_scalar": 168, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
    "sliding_window": 1024,
}
GEMMA3_27B = {
    "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
    "mm_tokens_per_image": 256, "text_config": GEMMA3_27B_TEXT,
    "vision_config": {"hidden_size": 1152, "intermediate_size": 4304, "model_type": "siglip_vision_model",
                      "num_attention_heads": 16, "num_hidden_layers": 27, "patch_size": 14},
}
PHI3_MINI = {
    "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_act": "silu",
    "hidden_size": 3072, "intermediate_size": 8192, "max_position_embeddings": 4096,
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
    "rms_norm_eps": 1e-05, "sliding_window": 2047, "tie_word_embeddings": False, "vocab_size": 32064,
}
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
    "decoder_sparse_step": 1, "head_dim": 128, "hidden_size": 2048, "intermediate_size": 6144,
    "max_window_layers": 48, "mlp_only_layers": [], "moe_intermediate_size": 768, "norm_topk_prob": True,
    "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
    "num_key_value_heads": 4, "sliding_window": None, "tie_word_embeddings": False,
    "use_sliding_window": False, "vocab_size": 151936,
}
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
    "intermediate_size": 14336, "num_attention_heads": 32, "num_experts_per_tok": 2,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8, "rope_theta": 1e6,
    "sliding_window": None, "tie_word_embeddings": False, "vocab_size": 32000,
}
# Qwen2-MoE keeps a window number around with use_sliding_window false: no window.
QWEN15_MOE_A27B = {
    "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "decoder_sparse_step": 1,
    "hidden_size": 2048, "intermediate_size": 5632, "max_window_layers": 21, "moe_intermediate_size": 1408,
    "num_attention_heads": 16, "num_experts": 60, "num_experts_per_tok": 4, "num_hidden_layers": 24,
    "num_key_value_heads": 16, "shared_expert_intermediate_size": 5632, "sliding_window": 32768,
    "tie_word_embeddings": False, "use_sliding_window": False, "vocab_size": 151936,
}


# Parameter counts against the published totals.

@pytest.mark.parametrize(("name", "total_b", "active_b"), [
    # Qwen3-8B: "8.2B" on the model card.
    ("qwen3-8b", 8.19, 8.19),
    # Gemma 3 27B: the card's 27.4B includes the SigLIP vision tower (~0.4B) and the projector;
    # the planner counts the language model only (text_config), which is 27.0B.
    ("gemma-3-27b", 27.01, 27.01),
    # Phi-3-mini: "3.8B".
    ("phi-3-mini", 3.82, 3.82),
    # Qwen3-30B-A3B: "30.5B total, 3.3B activated".
    ("qwen3-30b-a3b", 30.53, 3.35),
    # Mixtral-8x7B: "46.7B total, 12.9B per token".
    ("mixtral-8x7b", 46.70, 12.88),
    # Qwen1.5-MoE-A2.7B: "14.3B total, 2.7B activated" (embedding and lm head included).
    ("qwen1.5-moe-a2.7b", 14.32, 2.69),
])
def test_new_preset_params_match_published(name: str, total_b: float, active_b: float) -> None:
    params = count_params(get_model(name))
    assert params.total / 1e9 == pytest.approx(total_b, abs=0.01)
    assert params.active / 1e9 == pytest.approx(active_b, abs=0.01)


def test_moe_parts_by_hand() -> None:
    q = count_params(MODELS["qwen3-30b-a3b"])
    layers, h, expert = 48, 2048, 3 * 2048 * 768
    assert (q.mlp, q.shared_experts) == (0, 0)  # every layer is a MoE layer, no shared expert
    assert q.router == layers * h * 128
    assert q.experts == layers * 128 * expert and q.active_experts == layers * 8 * expert
    assert q.qk_norms == layers * 2 * 128  # one head_dim-wide weight for q and one for k
    assert q.norms == (2 * layers + 1) * h
    assert q.total == 30_532_122_624 and q.active == 3_353_032_704

    s = count_params(MODELS["qwen1.5-moe-a2.7b"])
    assert s.shared_experts == 24 * (3 * 2048 * 5632 + 2048)  # the shared MLP and its 1-output gate
    assert s.attention == 24 * (4 * 2048 * 2048 + 3 * 2048)  # q/k/v biases
    assert s.active - s.active_experts == s.total - s.experts  # everything but routed experts is active

    g = count_params(MODELS["gemma-3-27b"])
    assert g.norms == (4 * 62 + 1) * 5376 and g.qk_norms == 62 * 2 * 128 and g.lm_head == 0


def test_dense_models_have_active_equal_total_and_old_keys_unchanged() -> None:
    for name in ("llama-2-7b", "qwen2-7b", "qwen3-8b", "gemma-3-27b", "phi-3-mini"):
        params = count_params(MODELS[name])
        assert params.active == params.total
        assert params.router == params.experts == params.shared_experts == 0
    assert count_params(MODELS["llama-2-7b"]).total == 6_738_415_616


# Expert traffic.

@pytest.mark.parametrize(("experts", "top_k"), [(128, 8), (8, 2), (60, 4)])
def test_expected_experts_touched(experts: int, top_k: int) -> None:
    assert expected_experts_touched(experts, top_k, 1) == pytest.approx(top_k)
    assert expected_experts_touched(experts, top_k, 2) == pytest.approx(2 * top_k - top_k**2 / experts)
    assert expected_experts_touched(experts, top_k, 10_000) == pytest.approx(experts)
    by_batch = [expected_experts_touched(experts, top_k, b) for b in (1, 2, 8, 32, 256)]
    assert by_batch == sorted(by_batch) and by_batch[-1] <= experts
    assert expected_experts_touched(0, 0, 32) == 0.0  # dense


def test_expected_experts_touched_rejects_bad_arguments() -> None:
    with pytest.raises(InvalidParameterError):
        expected_experts_touched(8, 9, 1)
    with pytest.raises(InvalidParameterError):
        expected_experts_touched(8, 2, 0)


def test_decode_bytes_per_step() -> None:
    model, context = MODELS["qwen3-30b-a3b"], 4096
    params, kv = count_params(model), kv_bytes_per_token(model, "bf16")
    non_expert = bytes_for(params.total - params.experts, "bf16")
    one_expert = bytes_for(expert_params(model), "bf16")
    at_1 = decode_bytes_per_step(model, dtype="bf16", kv_dtype="bf16", context=context, batch=1)
    assert at_1 == non_expert + 48 * 8 * one_expert + context * kv
    at_32 = decode_bytes_per_step(model, dtype="bf16", kv_dtype="bf16", context=context, batch=32)
    touched = 128 * (1 - (1 - 8 / 128) ** 32)
    assert at_32 == pytest.approx(non_expert + 48 * touched * one_expert + 32 * context * kv, abs=1)
    # A large batch touches every expert: all the weights once.
    at_4k = decode_bytes_per_step(model, dtype="bf16", kv_dtype="bf16", context=1, batch=4096)
    assert at_4k == pytest.approx(bytes_for(params.total, "bf16") + 4096 * kv, rel=1e-9)
    # Dense: the weights once plus every sequence's KV.
    dense = MODELS["llama-3-8b"]
    assert decode_bytes_per_step(dense, dtype="fp16", kv_dtype="fp16", context=2048, batch=4) == (
        bytes_for(count_params(dense).total, "fp16") + 4 * 2048 * kv_bytes_per_token(dense, "fp16"))


# Sliding windows.

def test_window_aware_kv() -> None:
    gemma = MODELS["gemma-3-27b"]
    per_layer = 2 * 16 * 128 * 2  # K and V, KV heads, head_dim, fp16
    assert gemma.num_sliding_layers == 52  # every 6th of 62 layers is global: 10 global
    assert kv_bytes_per_token(gemma, "fp16") == 62 * per_layer  # flotilla keeps every layer's KV
    assert kv_bytes_per_sequence_window_aware(gemma, "fp16", 4096) == per_layer * (10 * 4096 + 52 * 1024)
    # Within the window nothing would be dropped.
    assert kv_bytes_per_sequence_window_aware(gemma, "fp16", 1024) == 1024 * kv_bytes_per_token(gemma, "fp16")
    # int8 KV: the per-token scales shrink with the window too.
    assert kv_bytes_per_sequence_window_aware(gemma, "int8", 4096) == (
        kv_bytes_per_token(gemma, "int8") // 62 * (10 * 4096 + 52 * 1024))

    report = plan(gemma, context=4096, batch=8)
    assert report.kv_bytes == 8 * 4096 * 62 * per_layer
    assert report.kv_bytes_per_token_window_aware == per_layer * (10 * 4096 + 52 * 1024) // 4096
    assert report.kv_bytes_window_aware == 8 * per_layer * (10 * 4096 + 52 * 1024)
    assert any("flotilla keeps their KV" in note for note in report.notes)

    phi = plan(MODELS["phi-3-mini"], context=4096)
    assert phi.kv_bytes_per_token_window_aware == -(-phi.kv_bytes_per_token * 2047 // 4096)
    llama = plan(MODELS["llama-3-8b"], context=4096)
    assert llama.kv_bytes_per_token_window_aware == llama.kv_bytes_per_token
    assert not any("window" in note for note in llama.notes)


def test_windowed_layers_pattern() -> None:
    assert windowed_layers(12, 6) == (0, 1, 2, 3, 4, 6, 7, 8, 9, 10)
    assert windowed_layers(4, 2) == (0, 2)
    assert windowed_layers(3, 1) == ()


# config.json parsing.

@pytest.mark.parametrize(("config", "preset"), [
    (QWEN3_8B, "qwen3-8b"), (GEMMA3_27B, "gemma-3-27b"), (PHI3_MINI, "phi-3-mini"),
    (QWEN3_30B_A3B, "qwen3-30b-a3b"), (MIXTRAL_8X7B, "mixtral-8x7b"), (QWEN15_MOE_A27B, "qwen1.5-moe-a2.7b"),
])
def test_hf_config_of_each_family_matches_its_preset(config: dict[str, object], preset: str) -> None:
    assert model_from_hf_config(config, name=preset) == MODELS[preset]


def test_gemma3_window_spellings() -> None:
    text = GEMMA3_27B_TEXT
    pattern = model_from_hf_config({**text, "sliding_window_pattern": 6, "vocab_size": 262208})
    kinds = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(62)]
    listed = model_from_hf_config({**text, "layer_types": kinds})
    assert pattern.sliding_layers == listed.sliding_layers == MODELS["gemma-3-27b"].sliding_layers
    assert pattern.sliding_window == listed.sliding_window == 1024
    # Gemma 2: every other layer windowed, four norms, no q/k norm.
    gemma2 = model_from_hf_config({"model_type": "gemma2", "hidden_size": 2304, "intermediate_size": 9216,
                                   "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                                   "num_hidden_layers": 26, "vocab_size": 256000, "sliding_window": 4096})
    assert gemma2.sliding_layers == tuple(range(0, 26, 2)) and gemma2.norms_per_layer == 4
    assert not gemma2.qk_norm and gemma2.tie_word_embeddings


def test_hf_config_windows_off_and_errors() -> None:
    # Qwen3 writes layer_types too; all full attention means no window.
    full = model_from_hf_config({**QWEN3_8B, "sliding_window": 4096, "layer_types": ["full_attention"] * 36})
    assert (full.sliding_window, full.sliding_layers) == (None, ())
    # Qwen2-style use_sliding_window: layers from max_window_layers on.
    on = model_from_hf_config({**QWEN3_8B, "sliding_window": 4096, "use_sliding_window": True,
                               "max_window_layers": 28})
    assert on.sliding_layers == tuple(range(28, 36))
    with pytest.raises(InvalidParameterError, match="linear_attention"):
        model_from_hf_config({**QWEN3_8B, "layer_types": ["linear_attention", "full_attention"] * 18})
    with pytest.raises(InvalidParameterError, match="no sliding_window"):
        model_from_hf_config({**QWEN3_8B, "layer_types": ["sliding_attention"] * 36})
    with pytest.raises(InvalidParameterError, match="one kind per layer"):
        model_from_hf_config({**QWEN3_8B, "layer_types": ["full_attention"] * 3})
    with pytest.raises(InvalidParameterError, match="num_experts_per_tok"):
        model_from_hf_config({k: v for k, v in MIXTRAL_8X7B.items() if k != "num_experts_per_tok"})
    with pytest.raises(InvalidParameterError, match="mlp_only_layers"):
        model_from_hf_config({**QWEN3_30B_A3B, "mlp_only_layers": [0, 99]})


def test_hf_config_sparse_step_and_mlp_only_layers() -> None:
    model = model_from_hf_config({**QWEN3_30B_A3B, "decoder_sparse_step": 2, "mlp_only_layers": [1]})
    assert model.moe_layers == tuple(i for i in range(3, 48, 2))  # (i + 1) % 2 == 0, layer 1 dense
    params = count_params(model)
    dense_layers = 48 - 23
    assert params.mlp == dense_layers * 3 * 2048 * 6144
    assert params.experts == 23 * 128 * 3 * 2048 * 768 and params.router == 23 * 2048 * 128


def test_model_arch_validates_moe_fields() -> None:
    base = MODELS["mixtral-8x7b"]
    for bad in ({"num_experts_per_tok": 9}, {"moe_intermediate_size": 0}, {"sliding_layers": (0,)},
                {"sliding_window": 0}):
        with pytest.raises(InvalidParameterError):
            dataclasses.replace(base, **bad)
    with pytest.raises(InvalidParameterError):
        ModelArch("dense", num_layers=2, hidden_size=8, num_heads=2, num_kv_heads=2, head_dim=4,
                  intermediate_size=16, vocab_size=10, tie_word_embeddings=True, num_experts_per_tok=2)


# The command.

NEW_KEYS = ("total_params", "active_params", "kv_bytes_per_token_window_aware", "kv_bytes_window_aware",
            "expected_experts_per_layer", "expected_experts_per_layer_batch1",
            "decode_bytes_per_step", "decode_bytes_per_step_batch1")


def test_cli_json_prints_the_new_keys(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(["plan", "--preset", "qwen3-30b-a3b", "--dtype", "bf16", "--context", "4096",
                              "--batch", "32", "--json"], capsys)
    assert code == 0, err
    data = json.loads(out)
    assert all(key in data for key in NEW_KEYS)
    assert data["num_params"] == data["total_params"] == 30_532_122_624
    assert data["active_params"] == 3_353_032_704
    assert data["expected_experts_per_layer_batch1"] == pytest.approx(8)
    assert data["expected_experts_per_layer"] == pytest.approx(128 * (1 - (120 / 128) ** 32))
    model = MODELS["qwen3-30b-a3b"]
    assert data["decode_bytes_per_step"] == decode_bytes_per_step(
        model, dtype="bf16", kv_dtype="bf16", context=4096, batch=32)
    assert data["decode_bytes_per_step_batch1"] < data["decode_bytes_per_step"]
    assert data["kv_bytes_per_token_window_aware"] == data["kv_bytes_per_token"] == 2 * 48 * 4 * 128 * 2
    assert {"router", "experts", "active_experts", "shared_experts", "qk_norms"} <= set(data["params"])
    assert data["model"]["num_experts"] == 128


def test_cli_text_shows_active_decode_and_window(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(["plan", "--preset", "mixtral-8x7b", "--batch", "32"], capsys)
    assert code == 0, err
    assert "46.70 B" in out and "active      12.88 B per token" in out
    assert "distinct experts per MoE layer: 2.0 at batch 1, 8.0 at batch 32 of 8" in out
    config = tmp_path / "config.json"
    config.write_text(json.dumps(GEMMA3_27B))
    code, out, err = run_cli(["plan", "--config", str(config), "--context", "4096"], capsys)
    assert code == 0, err
    assert "sliding window 1,024 on 52 of 62 layers" in out
    assert "window-aware (out-of-window KV dropped; flotilla keeps it): 188,416 B per token" in out
    assert "507,904 B per token" in out


def test_cli_moe_config_error_names_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**MIXTRAL_8X7B, "num_experts_per_tok": 12}))
    code, _, err = run_cli(["plan", "--config", str(config)], capsys)
    assert code == 2 and "--config" in err and "num_experts_per_tok" in err and "Traceback" not in err
