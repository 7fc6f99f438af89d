"""``flotilla plan --workload``: the smallest layouts that meet the SLOs, by simulation, and the JSON keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli.main import main
from cli.plan.workload import Sizer, parse_slo, workload_trace
from cli.simulate.fleet import Disaggregation
from cli.simulate.profile import Capacity, LinearProfile
from cli.simulate.trace import generate
from scheduling.errors import InvalidParameterError

LAYOUT_KEYS = ("gpus", "prefill_gpus", "decode_gpus", "goodput_req_per_s", "cost_per_1m_tokens")


def test_smallest_finds_the_first_count_that_meets() -> None:
    sizer = Sizer(LinearProfile(Capacity(64), 0.01, 0, 0, 0, 0, 0), [], {"ttft_p95_ms": 1, "tpot_p95_ms": 1},
                  Disaggregation())
    calls: list[int] = []

    def meets(n: int) -> bool:
        calls.append(n)
        return n >= 11

    assert sizer.smallest(meets, 64) == 11
    assert len(calls) <= 10  # doubling to 16, then bisection between 8 and 16
    assert sizer.smallest(lambda n: False, 8) is None


def test_workload_specs_and_slos_are_read_or_refused_by_name() -> None:
    assert workload_trace("prompt_tokens=100,output_tokens=20,rate=3", 2.0) == \
        "poisson:rate=3.0,minutes=2.0,prompt_tokens=100,output_tokens=20,spread=0"
    assert workload_trace("diurnal:peak=5,minutes=1", 2.0) == "diurnal:peak=5,minutes=1"
    assert parse_slo("ttft_p95_ms=500,tpot_p95_ms=40") == {"ttft_p95_ms": 500.0, "tpot_p95_ms": 40.0}
    for bad, param in (("prompt_tokens=100,rate=3", "workload"), ("ttft_p95_ms=500", "slo"),
                       ("ttft_p95_ms=0,tpot_p95_ms=1", "slo"), ("ttft=1,tpot_p95_ms=1", "slo")):
        with pytest.raises(InvalidParameterError) as err:
            (workload_trace(bad, 1.0) if param == "workload" else parse_slo(bad))
        assert err.value.param == param


def test_the_command_sizes_both_layouts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A replica of 2 sequences whose steps take 20 ms + 0.2 ms per token serves about 4 req/s of 200 + 20 tokens:
    10 req/s needs several; the colocated count the plan gives meets the SLOs and one fewer does not."""
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps(LinearProfile(Capacity(512, 16, 2, 512, 1024), 0.02, 2e-4, 0.0, 0.0, 0.0,
                                                0.0).to_dict()))
    argv = ["plan", "--workload", "prompt_tokens=200,output_tokens=20,rate=10", "--slo",
            "ttft_p95_ms=1500,tpot_p95_ms=200", "--profile", str(profile), "--preset", "llama-3-8b",
            "--max-gpus", "8", "--minutes", "0.5", "--price-per-hour", "2"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["recommended"] in ("colocated", "disaggregated")
    for layout in ("colocated", "disaggregated"):
        assert out[layout]["fits"] is True
        for key in LAYOUT_KEYS:
            assert key in out[layout], (layout, key)
        assert out[layout]["gpus"] == out[layout]["prefill_gpus"] + out[layout]["decode_gpus"] <= 8
        assert out[layout]["ttft_p95_ms"] <= 1500 and out[layout]["tpot_p95_ms"] <= 200
    n = out["colocated"]["gpus"]
    assert n > 1 and any(line.startswith(f"colocated: {n - 1} replica(s) miss") for line in out["why"])
    assert out["colocated"]["cost_per_1m_tokens"] > 0


def test_sizing_without_a_profile_or_gpu_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--workload", "prompt_tokens=200,output_tokens=20,rate=10"]) == 2
    assert "--workload" in capsys.readouterr().err
    assert main(["plan", "--gpu", "H200"]) == 2  # the memory plan still needs a model
    assert "--preset" in capsys.readouterr().err


def test_generated_traces_feed_the_sizer() -> None:
    assert len(generate(workload_trace("prompt_tokens=10,output_tokens=2,rate=4", 0.5))) > 60
