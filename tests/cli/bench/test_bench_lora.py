"""``flotilla bench lora``: the adapters it writes, a whole run on tiny, and settings it refuses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from actors.load.lora_adapter import LORA_TARGETS, read_adapter
from cli.bench.lora.adapters import ALL_PROJECTIONS, ProjectionShapes, write_adapters
from cli.bench.lora.served import counter_totals
from cli.main import main
from scheduling.errors import InvalidParameterError

TINY_RUN = ["--runs", "1", "--steps", "2", "--context", "16", "--max-model-len", "64", "--cycle-max-loras", "2",
            "--cycle-adapters", "3", "--cycle-requests", "6", "--cycle-prompt-len", "8", "--cycle-max-tokens", "3",
            "--cycle-runs", "1", "--json"]


def test_written_adapters_read_back_with_the_models_shapes(tiny_model_dir: Path, tmp_path: Path) -> None:
    shapes = ProjectionShapes.of(tiny_model_dir)
    first, second = write_adapters(tiny_model_dir, tmp_path, 2, rank=4, seed=7)
    a = read_adapter("a", first, max_rank=4, num_layers=shapes.num_layers)
    b = read_adapter("b", second, max_rank=4, num_layers=shapes.num_layers)
    assert a.rank == 4 and a.scaling == 2.0 and set(a.targets) == set(ALL_PROJECTIONS)
    assert len(a.parts) == shapes.num_layers * len(ALL_PROJECTIONS)
    by_key = {(p.layer, p.module, p.part): p for p in b.parts}
    for part in a.parts:
        hf = next(name for name, where in LORA_TARGETS.items() if where == (part.module, part.part))
        assert (part.a.shape[1], part.b.shape[0]) == shapes.features[hf]
        assert part.b.abs().sum() > 0  # a zero B (PEFT's init) would make the adapter a no-op
        assert not part.a.equal(by_key[(part.layer, part.module, part.part)].a)  # seeds differ per adapter


def test_a_whole_run_on_tiny(tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "lora", "--model", str(tiny_model_dir), *TINY_RUN]) == 0
    out = json.loads(capsys.readouterr().out)
    base, lora = out["base_step_ms"], out["lora_step_ms"]
    assert set(lora) == {"1", "8", "32"}
    assert base > 0 and all(ms > 0 for ms in lora.values()) and out["base_step_ms_no_lora_engine"] > 0
    assert out["overhead_8"] == round(lora["8"] / base, 4) > 0
    assert out["settings"]["batch_size"] == 32 and out["settings"]["steps"] == 2
    assert len(out["per_run"]) == 1
    cyc = out["cycling"]
    assert cyc["lora_output_tok_per_s"] > 0 and cyc["base_output_tok_per_s"] > 0
    assert cyc["per_run"][0]["lora"]["output_tokens"] == cyc["per_run"][0]["base"]["output_tokens"] == 6 * 3
    # Three adapters through two slots: the one left out of the slots after the warm-up is written into
    # one at least once; the base writes none.
    assert cyc["lora_slot_loads"] >= 1 and cyc["per_run"][0]["base"]["slot_loads"] == 0
    # Requests wait for a slot, so the LoRA batches are smaller than the base's (all 6 at once).
    assert cyc["base_mean_seqs_per_step"] > cyc["lora_mean_seqs_per_step"]
    # Against the settings, not the output: the base runs all 6 requests in each of 3 steps (a prefill step
    # gives token 1, two decode steps tokens 2 and 3); either way each request is in 3 steps, 18 in all.
    assert (cyc["base_steps"], cyc["base_mean_seqs_per_step"]) == (3, 6)
    assert cyc["lora_steps"] > 3
    assert cyc["lora_mean_seqs_per_step"] * cyc["lora_steps"] == pytest.approx(6 * 3, abs=0.005 * cyc["lora_steps"])


@pytest.mark.parametrize(("flags", "name"), [
    (["--cycle-adapters", "2", "--cycle-max-loras", "2"], "cycle_adapters"),
    (["--steps", "0"], "steps"),
    (["--context", "100", "--max-model-len", "64"], "max_model_len"),
])
def test_bad_settings_are_refused_by_name(flags: list[str], name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "lora", "--model", "tiny", *flags]) == 2
    assert name in capsys.readouterr().err


def test_a_non_llama_config_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(InvalidParameterError, match="not a Llama-family config.json"):
        ProjectionShapes.of(tmp_path)


@pytest.mark.parametrize(("flags", "name"), [
    (["--served-replicas", "0"], "served_replicas"),
    (["--served-requests", "-1"], "served_requests"),
])
def test_bad_served_settings_are_refused_by_name(flags: list[str], name: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "lora", "--served", "--model", "tiny", *flags]) == 2
    assert name in capsys.readouterr().err


def test_served_counters_are_read_per_replica_and_summed_over_adapters() -> None:
    text = "\n".join([
        "# TYPE flotilla:lora_requests counter",
        'flotilla:lora_requests_total{model_name="tiny",replica="r1",adapter="a"} 3.0',
        'flotilla:lora_requests_total{model_name="tiny",replica="r1",adapter="b"} 2.0',
        'flotilla:lora_requests_total{model_name="tiny",replica="r2",adapter="a"} 4.0',
        "# TYPE flotilla:lora_loads counter",
        'flotilla:lora_loads_total{model_name="tiny",replica="r1"} 2.0',
        "# TYPE flotilla:lora_resident_hits counter",
        'flotilla:lora_resident_hits_total{model_name="tiny",replica="r1"} 3.0',
        "# TYPE flotilla:engine_steps counter",
        'flotilla:engine_steps_total{model_name="tiny",replica="r1"} 99.0',
    ]) + "\n"
    got = counter_totals(text)
    assert got == {"r1": {"lora_requests": 5.0, "lora_resident_hits": 3.0, "lora_loads": 2.0},
                   "r2": {"lora_requests": 4.0, "lora_resident_hits": 0.0, "lora_loads": 0.0}}
