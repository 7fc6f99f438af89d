"""``flotilla bench profile``: the fit recovers a known model; a small run on tiny makes a profile simulate reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli.bench.profile import served
from cli.bench.profile.run import fit, run
from cli.bench.profile.served import fit_host_cores, run_served
from cli.main import main
from cli.simulate.profile import LinearProfile, StepShape, load_profile
from scheduling.errors import InvalidParameterError
from tests.shared_ray import SHARED

pytestmark = pytest.mark.ray  # on the session's shared cluster: run with the other Ray modules, last (tests/conftest.py)


def test_the_fit_recovers_known_coefficients_and_keeps_them_non_negative() -> None:
    truth = (0.002, 5e-5, 2e-5, 1e-3, 3e-7, 1e-8)
    shapes = [StepShape(t, 1, 1, t, t * t, t * t) for t in (16, 64, 256, 1024)]
    shapes += [StepShape(b, b, 0, b * c, b * c, 0) for b in (1, 8, 32) for c in (64, 1024)]

    def seconds(s: StepShape, c: tuple[float, ...]) -> float:
        return c[0] + c[1] * s.tokens + c[2] * s.seqs + c[3] * s.prefills + c[4] * s.context_tokens + c[5] * s.prefill_pairs

    got = fit([(s, seconds(s, truth)) for s in shapes])
    assert got == pytest.approx(truth, rel=1e-6)
    # Times that fall with sequences: the fit drops that term instead of making it negative.
    bent = fit([(s, seconds(s, truth) - 1e-6 * s.seqs) for s in shapes])
    assert min(bent) >= 0


def test_a_small_run_writes_a_profile_simulate_reads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = run("tiny", runs=1, steps=2, prefill_tokens=(16, 64, 128), decode_batches=(1, 4), decode_contexts=(32, 96))
    assert len(out["points"]) == 3 + 2 * 2
    profile = out["profile"]
    assert profile["kind"] == "linear" and profile["capacity"]["max_num_seqs"] == 4
    assert all(profile[k] >= 0 for k in ("overhead_s", "per_token_s", "per_seq_s", "per_prefill_s",
                                          "per_context_token_s", "per_prefill_pair_s"))
    assert all(p["ms"] > 0 for p in out["points"]) and out["fit_max_rel_error"] >= 0
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile))
    loaded = load_profile(path)
    assert isinstance(loaded, LinearProfile) and loaded.capacity.max_num_seqs == 4
    assert main(["simulate", "--trace", "poisson:rate=2,minutes=0.2,prompt_tokens=32,output_tokens=8",
                 "--profile", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["finished"] > 0


def test_host_cores_fit_the_simulators_slowdown_rule() -> None:
    assert fit_host_cores({1: 1.0, 2: 2.0, 4: 4.0}) == pytest.approx(1.0)
    assert fit_host_cores({1: 1.0, 2: 1.0, 4: 2.0}) == pytest.approx(20 / 10)  # sum K^2 / sum K s_K
    with pytest.raises(InvalidParameterError) as err:
        fit_host_cores({1: 1.0})
    assert err.value.param == "host_replicas"


def test_host_replicas_need_a_served_profile(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "profile", "--host-replicas", "2"]) == 2
    assert "host_replicas" in capsys.readouterr().err
    # Refused before any cluster starts: one replica alone has nothing to compare against.
    assert main(["bench", "profile", "--served", "--num-kv-pages", "64", "--host-replicas", "1"]) == 2
    assert "host_replicas" in capsys.readouterr().err


def test_a_served_profile_times_the_shapes_through_a_replica(ray_cluster: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """One replica of tiny on a local Ray cluster, over HTTP: every point measured, the replica's limits kept;
    then one and two replicas busy, and two with requests waiting: the host's share measured (shorter
    decodes and queues than a real measurement's, to keep the test short)."""
    # On the session's cluster (its Serve port); on its own run_served starts a private one (harness.serve_on).
    SHARED.serve_url()
    monkeypatch.setattr(served, "HOST_STEPS", 16)
    monkeypatch.setattr(served, "HOST_WAITING_PER_REPLICA", 8)
    out = run_served("tiny", runs=1, steps=2, num_cpus=2, prefill_tokens=(16, 64), decode_batches=(1, 2),
                     decode_contexts=(32,), num_kv_pages=64, max_num_seqs=2, cpu_threads=1, host_replicas=(2,),
                     serve_port=SHARED.serve_port)
    host = out["host"]
    assert host["replicas"] == [1, 2] and all(t > 0 for t in host["step_ms"]) and host["slowdown"][0] == 1.0
    assert host["waiting"] == 2 * 8 and host["waiting_step_ms"] > 0 and host["output_tokens"] == 17
    assert len(host["start_s"]) == 2 and host["host_share_per_waiting"] >= 0
    assert out["profile"]["host_cores"] == pytest.approx(2 / host["slowdown"][1], rel=1e-2)  # K=2 alone: 2/s_2
    assert [p["shape"] for p in out["points"]] == ["prefill16", "prefill64", "decode1x32", "decode2x32"]
    assert all(p["ms"] > 0 for p in out["points"])
    capacity = out["profile"]["capacity"]
    assert capacity["num_kv_pages"] == 64 and capacity["max_num_seqs"] == 2
    assert out["profile"]["source"].startswith("bench profile --served")
