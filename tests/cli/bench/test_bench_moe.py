"""``flotilla bench moe`` on a small pair: the keys, the pair's arithmetic, and refusals."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cli.bench.moe.models import PairShape, dense_config, moe_config
from cli.bench.moe.run import run
from cli.main import main
from cli.plan.hardware import model_from_hf_config
from cli.plan.planner import count_params
from scheduling.errors import InvalidParameterError

SMALL = PairShape(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, experts=8, top_k=2, moe_intermediate=32)
RUN: dict[str, Any] = {"batch": 4, "prompt_len": 8, "max_tokens": 4, "steps": 2, "runs": 1}


def test_the_pair_has_the_same_active_parameters_and_top_k_times_wider_dense_mlp() -> None:
    moe, dense = (count_params(model_from_hf_config(c.to_dict())) for c in (moe_config(SMALL), dense_config(SMALL)))
    assert dense_config(SMALL).intermediate_size == SMALL.top_k * SMALL.moe_intermediate
    router = SMALL.layers * SMALL.hidden * SMALL.experts
    assert moe.active == dense.active + router
    assert moe.total - dense.total == router + SMALL.layers * (SMALL.experts - SMALL.top_k) * 3 * 64 * 32


def test_a_small_run_prints_both_models_and_their_ratios(tmp_path: Path) -> None:
    out = run(shape=SMALL, models_root=tmp_path, **RUN)
    for name in ("moe", "dense"):
        figures = out[name]
        for key in ("output_tok_per_s", "total_tok_per_s", "prefill_tok_per_s", "decode_step_ms",
                    "decode_step_ms_batch1", "decode_bytes_per_step", "decode_bytes_per_step_batch1"):
            assert figures[key] > 0, (name, key)
        assert Path(figures["model"]).parent == tmp_path / "models"
    # Against the shape by hand, not the planner: batch b of tokens each picking 2 of 8 experts reaches
    # 8 (1 - (6/8)^b) distinct experts a layer (5.47 at 4); an expert's MLP is 3 x 64 x 32 float32.
    touched4 = 8 * (1 - (6 / 8) ** 4)
    assert out["moe"]["expected_experts_per_layer"] == {"batch1": 2.0, "batch4": round(touched4, 2)}
    expert_bytes, router_bytes = 3 * 64 * 32 * 4, 64 * 8 * 4
    # A decode step's bytes differ only in the MLPs: the experts touched and the router against the dense MLP,
    # as wide as top_k experts; embeddings, attention and KV are the same in both.
    for key, touched in (("decode_bytes_per_step", touched4), ("decode_bytes_per_step_batch1", 2)):
        diff = out["moe"][key] - out["dense"][key]
        assert diff == round(2 * (touched * expert_bytes + router_bytes - 2 * expert_bytes)), key
    # Every request generates max_tokens after its prompt: total over output tok/s is (8 + 4) / 4.
    for name in ("moe", "dense"):
        assert out[name]["total_tok_per_s"] / out[name]["output_tok_per_s"] == pytest.approx(3.0, rel=1e-2)
    assert out["dense"]["expected_experts_per_layer"] == {"batch1": 0.0, "batch4": 0.0}
    assert out["ratio_active_params"] == pytest.approx(1.0, abs=0.05)
    assert out["ratio_output_tok_per_s"] == pytest.approx(
        out["moe"]["output_tok_per_s"] / out["dense"]["output_tok_per_s"], rel=1e-3)
    assert out["ratio_decode_bytes_per_step"] > 1  # batch 4 touches more than top-k experts per layer
    # Alone, a token reads its top-k experts: the same expert bytes as the dense MLP (plus the router).
    assert out["ratio_decode_bytes_per_step_batch1"] == pytest.approx(1.0, abs=0.02)
    json.dumps(out)
    # A second run finds the written folders (named by their config and seed) and writes nothing.
    again = run(shape=SMALL, models_root=tmp_path, **RUN)
    assert again["moe"]["model"] == out["moe"]["model"]
    assert len(list((tmp_path / "models").iterdir())) == 2


@pytest.mark.parametrize(("kwargs", "param"), [({"batch": 0}, "batch"), ({"runs": -1}, "runs"),
                                               ({"max_num_seqs": 8}, "max_num_seqs")])
def test_bad_settings_are_refused_by_name(tmp_path: Path, kwargs: dict[str, int], param: str) -> None:
    with pytest.raises(InvalidParameterError) as err:
        run(shape=SMALL, models_root=tmp_path, **{**RUN, **kwargs})
    assert err.value.param == param
    assert not (tmp_path / "models").exists()


def test_the_command_is_listed(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "moe", "--help"])
    assert "--experts" in capsys.readouterr().out
