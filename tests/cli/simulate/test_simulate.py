"""``flotilla simulate``: traces, the simulated replica against exact step arithmetic, the fleet's policies."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from cli.main import main
from cli.simulate.fleet import Disaggregation, Fleet, FleetConfig, FleetRun, GiveUp
from cli.simulate.profile import Capacity, LinearProfile, StepShape, load_profile, roofline_profile
from cli.simulate.run import read_config
from cli.simulate.trace import Arrival, generate, load_trace
from cluster.autoscaling_pools import AutoscalingConfig
from scheduling.errors import InvalidParameterError

ISSUE_KEYS = ("requests", "ttft_p50_ms", "ttft_p95_ms", "tpot_p95_ms", "goodput_req_per_s", "replica_seconds",
              "max_replicas", "scale_events", "wall_s")


def _profile(step_s: float = 0.01, *, per_token_s: float = 0.0, num_kv_pages: int = 256,
             max_num_seqs: int = 8) -> LinearProfile:
    return LinearProfile(Capacity(num_kv_pages, 16, max_num_seqs, 256, 1024), step_s, per_token_s, 0.0, 0.0, 0.0,
                         0.0)


def _all_pages_free(fleet: Fleet) -> None:
    for replica in fleet.replicas:
        alloc = replica.policy.allocator
        assert alloc.num_free_pages == alloc.num_pages, replica.name
        assert not replica.tracked


def test_a_lone_request_takes_exactly_its_steps() -> None:
    """Prompt 40 tokens (one prefill step, which samples the first token), 5 output tokens (4 more steps)."""
    fleet = Fleet(_profile(0.01), FleetConfig(startup_s=0))
    run = fleet.run([Arrival(1.0, 40, 5), Arrival(10.0, 40, 5)])
    assert len(run.results) == 2 and run.rejected == run.unfinished == 0
    for r in run.results:
        assert r.ttft_s == pytest.approx(0.01)
        assert r.e2e_s == pytest.approx(0.05)
        assert r.tpot_s == pytest.approx(0.01)
        assert r.output_tokens == 5
    _all_pages_free(fleet)


def test_chunked_prefill_and_a_shared_batch_follow_the_scheduler() -> None:
    """A 600-token prompt over a 256-token budget takes 3 chunks; a request arriving meanwhile joins the batch."""
    fleet = Fleet(_profile(0.01), FleetConfig(startup_s=0))
    run = fleet.run([Arrival(0.0, 600, 3), Arrival(0.005, 10, 3)])
    by_len = {r.prompt_tokens: r for r in run.results}
    assert by_len[600].ttft_s == pytest.approx(0.03)  # chunks end at 0.01, 0.02, 0.03
    # The short one arrives during the first chunk. The second chunk fills the step's 256-token budget (the
    # running request goes first), so it joins the third step beside the last 88 prompt tokens.
    assert by_len[10].ttft_s == pytest.approx(0.03 - 0.005)
    _all_pages_free(fleet)


def test_requests_that_do_not_fit_are_rejected_and_every_request_is_counted() -> None:
    fleet = Fleet(_profile(), FleetConfig(startup_s=0))
    run = fleet.run([Arrival(0.0, 2000, 4), Arrival(0.0, 1000, 100), Arrival(0.1, 20, 4)])
    assert run.rejected == 2 and len(run.results) == 1


def _overload(policy: str) -> tuple[Fleet, FleetRun]:
    """2 req/s for 2 minutes, then nothing, on replicas that serve about one request a second."""
    trace = [Arrival(i * 0.5, 64, 64) for i in range(240)]
    scaling = AutoscalingConfig(min_replicas=1, max_replicas=6, target_queue_per_replica=2, slo_ttft_ms=1000,
                                slo_tpot_ms=1000, upscale_delay_s=5, downscale_delay_s=10)
    fleet = Fleet(_profile(0.015, max_num_seqs=1),
                  FleetConfig(policy=policy, autoscaling=scaling, startup_s=5, target_ongoing_requests=2))
    return fleet, fleet.run(trace)


@pytest.mark.parametrize("policy", ["flotilla", "default"])
def test_overload_scales_up_within_bounds_and_serves_every_request(policy: str) -> None:
    fleet, run = _overload(policy)
    assert len(run.results) == 240 and run.unfinished == 0
    assert 1 < run.max_replicas <= 6
    assert run.scale_events and run.scale_events[0].replicas > 1
    # Replica-seconds: every replica from its request to its stop (the run goes on until the fleet is back at
    # its minimum: 600 s of Serve's downscale delay for the default policy), never more than 6 at once.
    assert run.settled_s >= run.duration_s and run.replica_seconds <= 6 * run.settled_s
    assert run.replica_seconds == pytest.approx(sum(r.stopped - r.started for r in fleet.replicas
                                                    if r.stopped is not None))
    _all_pages_free(fleet)


def test_the_flotilla_policy_drains_back_to_the_minimum_after_the_load() -> None:
    fleet, run = _overload("flotilla")
    assert run.timeline[-1][1] == 1  # replicas asked for at the end
    downs = [e for e in run.scale_events if "down" in e.reason]
    assert downs and all(b.replicas < a.replicas or "up" in b.reason
                         for a, b in zip(run.scale_events, run.scale_events[1:], strict=False) if b in downs)


def test_diurnal_trace_follows_its_rate() -> None:
    arrivals = generate("diurnal:peak=20,minutes=5,spread=0,prompt_tokens=100,output_tokens=10")
    # The mean of 0.1 + 0.9 sin^2 over the day is 0.55.
    assert len(arrivals) == pytest.approx(20 * 0.55 * 300, rel=0.05)
    first_minute = sum(a.t < 60 for a in arrivals)
    middle_minute = sum(120 <= a.t < 180 for a in arrivals)
    assert middle_minute > 3 * first_minute
    assert {(a.prompt_tokens, a.output_tokens) for a in arrivals} == {(100, 10)}
    assert generate("diurnal:peak=20,minutes=5") == generate("diurnal:peak=20,minutes=5")


@pytest.mark.parametrize("spec", ["weekly:rate=1", "poisson:rate", "poisson:rate=-1", "poisson:speed=3",
                                  "poisson:rate=fast"])
def test_bad_trace_specs_are_refused_by_name(spec: str) -> None:
    with pytest.raises(InvalidParameterError) as err:
        generate(spec)
    assert err.value.param == "trace"


def test_a_jsonl_trace_is_sorted_and_a_bad_line_is_named(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text('{"t": 2.0, "prompt_tokens": 5, "output_tokens": 3}\n\n'
                    '{"t": 1.0, "prompt_tokens": 7, "output_tokens": 2}\n')
    assert load_trace(str(path)) == [Arrival(1.0, 7, 2), Arrival(2.0, 5, 3)]
    path.write_text('{"t": 1.0, "prompt_tokens": 7, "output_tokens": 2}\n{"t": 2.0}\n')
    with pytest.raises(InvalidParameterError, match=r"trace.jsonl:2"):
        load_trace(str(path))


def test_the_roofline_of_a_decode_step_is_its_weights_over_bandwidth() -> None:
    p = roofline_profile("llama-3-8b", "H200")
    one = p.step_seconds(StepShape(1, 1, 0, 1, 1, 0))
    assert one == pytest.approx(p.overhead_s + p.weight_bytes / 4.8e12, rel=1e-3)
    # A long prefill is compute-bound: 2 x active params per token over the peak rate.
    big = p.step_seconds(StepShape(8192, 1, 1, 8192, 8192 * 8192, 8192 * 8192))
    assert big > p.overhead_s + 2 * p.active_params * 8192 / p.peak_flops
    assert p.to_dict()["kind"] == "roofline"
    with pytest.raises(InvalidParameterError) as err:
        roofline_profile("llama-3-70b", "L4")
    assert err.value.param == "gpu"


def test_a_profile_file_round_trips_and_a_bad_one_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps(_profile().to_dict()))
    assert load_profile(path) == _profile()
    path.write_text(json.dumps({"kind": "linear"}))
    with pytest.raises(InvalidParameterError) as err:
        load_profile(path)
    assert err.value.param == "profile"


def test_the_command_prints_the_issue_keys(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "fleet.yaml"
    config.write_text("policy: flotilla\nstartup_s: 10\nautoscaling:\n  max_replicas: 4\n  upscale_delay_s: 5\n")
    png = tmp_path / "timeline.png"
    assert main(["simulate", "--trace", "poisson:rate=20,minutes=0.5,prompt_tokens=256,output_tokens=64",
                 "--gpu", "H200", "--model", "llama-3-8b", "--config", str(config), "--png", str(png),
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ISSUE_KEYS:
        assert key in out, key
    assert out["requests"] == out["finished"] + out["rejected_max_model_len"] + out["unfinished"]
    assert out["max_replicas"] <= 4 and isinstance(out["scale_events"], list)
    assert 0 < out["ttft_p50_ms"] <= out["ttft_p95_ms"] and out["goodput_req_per_s"] > 0
    assert math.isfinite(out["replica_seconds"]) and png.stat().st_size > 0


@pytest.mark.parametrize(("argv", "param"), [
    (["--profile", "p.json", "--gpu", "H200", "--model", "llama-3-8b"], "profile"),
    (["--gpu", "H200"], "profile"),
    (["--gpu", "B300", "--model", "llama-3-8b"], "gpu"),
])  # fmt: skip
def test_bad_profiles_are_refused_by_name(argv: list[str], param: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--trace", "poisson:rate=1,minutes=1", *argv]) == 2
    assert param in capsys.readouterr().err


def test_replicas_sharing_host_cores_slow_each_other_down() -> None:
    """Two replicas on one core: the second step to start while the first runs takes twice as long."""
    config = FleetConfig(startup_s=0, initial_replicas=2, host_cores=1,
                         autoscaling=AutoscalingConfig(min_replicas=2, max_replicas=2))
    fleet = Fleet(_profile(0.01), config)
    run = fleet.run([Arrival(0.0, 10, 1), Arrival(0.001, 10, 1)])
    assert sorted(r.ttft_s for r in run.results) == pytest.approx([0.01, 0.02])
    with pytest.raises(InvalidParameterError) as err:
        FleetConfig(host_cores=0)
    assert err.value.param == "host_cores"


def test_a_measured_host_share_counts_starting_replicas_and_waiting_requests() -> None:
    """The profile's host_cores applies without a config figure; a starting replica takes a share of the host
    as a stepping one does, and each waiting request its measured fraction of one."""
    profile = dataclasses.replace(_profile(0.01, max_num_seqs=1), host_cores=1.0, host_share_per_waiting=0.5)
    one = AutoscalingConfig(min_replicas=1, max_replicas=1)
    fleet = Fleet(profile, FleetConfig(startup_s=0, autoscaling=one))
    # A, then B and C while A runs: B's step starts with C waiting (1 + 0.5 -> 15 ms), C's with none.
    run = fleet.run([Arrival(0.0, 10, 1), Arrival(0.001, 10, 1), Arrival(0.002, 10, 1)])
    assert [r.ttft_s for r in sorted(run.results, key=lambda r: r.start_s)] == pytest.approx(
        [0.01, 0.025 - 0.001, 0.035 - 0.002])
    _all_pages_free(fleet)
    fleet = Fleet(profile, FleetConfig(startup_s=0, autoscaling=one))
    fleet.pools[0].add_replica(0.0, ready_at=60.0)  # asked for, still starting when the request runs
    run = fleet.run([Arrival(0.0, 10, 1)])
    assert run.results[0].ttft_s == pytest.approx(0.02)
    # A config's figure overrides the profile's.
    fleet = Fleet(profile, FleetConfig(startup_s=0, autoscaling=one, host_cores=4.0))
    assert fleet.run([Arrival(0.0, 10, 1), Arrival(0.001, 10, 1)]).results[1].ttft_s == pytest.approx(0.019)


def test_the_default_policy_acts_once_its_direction_held_for_the_delay() -> None:
    """A load that keeps growing changes the wanted count every tick; Serve counts decisions by direction, so
    the fleet still scales up once the upscale delay (30 s) has passed, to the latest count."""
    trace = [Arrival(i * 0.05, 64, 400) for i in range(1200)]  # 20 req/s, each ~6 s on a replica of 1
    fleet = Fleet(_profile(0.015, max_num_seqs=1),
                  FleetConfig(policy="default", autoscaling=AutoscalingConfig(min_replicas=1, max_replicas=8),
                              startup_s=0, target_ongoing_requests=2))
    # Only the first scale event (~30 s) is asserted, and a simulation is causal: the run is cut once 1% of
    # the requests (12; about 5 finish before the event) have missed a 1 s TTFT, soon after that event,
    # instead of serving all 480k output tokens (one decode step each) to the end. Up to the cut it is the
    # same run.
    run = fleet.run(trace, GiveUp(ttft_s=1.0, tpot_s=1.0, fraction=0.01))
    assert run.gave_up == "ttft"
    first = run.scale_events[0]
    assert 30 <= first.t <= 32 and first.replicas == 8


def _pd_config(*, prefill: int = 1, decode: int = 1, min_remote: int = 100) -> FleetConfig:
    return FleetConfig(startup_s=0, autoscaling=AutoscalingConfig(min_replicas=decode, max_replicas=decode,
                                                                  pool="decode"),
                       disaggregation=Disaggregation(
                           prefill=AutoscalingConfig(min_replicas=prefill, max_replicas=prefill, pool="prefill"),
                           kv_transfer_bytes_per_s=1e6, remote_prefill_min_tokens=min_remote,
                           kv_bytes_per_token=1000))


def test_a_prefilled_request_decodes_on_the_decode_pool_after_its_kv_arrives() -> None:
    """600 prompt tokens: 3 prefill chunks (0.03 s), 600 x 1000 B at 1 MB/s (0.6 s), then 4 decode steps."""
    fleet = Fleet(_profile(0.01), _pd_config())
    run = fleet.run([Arrival(0.0, 600, 5), Arrival(5.0, 40, 5)])
    assert run.handoffs == 1 and run.unfinished == 0
    by_len = {r.prompt_tokens: r for r in run.results}
    assert by_len[600].ttft_s == pytest.approx(0.63)
    assert by_len[600].e2e_s == pytest.approx(0.67) and by_len[600].output_tokens == 5
    # A prompt under remote_prefill_min_tokens is prefilled on the decode replica itself.
    assert by_len[40].ttft_s == pytest.approx(0.01) and by_len[40].e2e_s == pytest.approx(0.05)
    decode = [r for r in fleet.replicas if r.name.startswith("decode")]
    assert sum(r.steps for r in decode) == 4 + 5  # the imported prompt computed nothing there
    _all_pages_free(fleet)


def test_disaggregation_reads_from_yaml(tmp_path: Path) -> None:
    path = tmp_path / "pd.yaml"
    path.write_text("startup_s: 0\nautoscaling: {min_replicas: 3, max_replicas: 3}\n"
                    "disaggregation:\n  prefill: {min_replicas: 1, max_replicas: 1}\n  kv_transfer_bytes_per_s: 5e10\n")
    config = read_config(path, {})
    assert config.disaggregation is not None and config.disaggregation.prefill.pool == "prefill"
    assert config.autoscaling.pool == "decode" and config.disaggregation.kv_transfer_bytes_per_s == 5e10
    path.write_text("disaggregation: {prefill: {max_replicas: 2}, link: 3}\n")
    with pytest.raises(InvalidParameterError, match="link"):
        read_config(path, {})
    with pytest.raises(InvalidParameterError) as err:  # a measured profile cannot size the hand-off itself
        Fleet(_profile(), FleetConfig(disaggregation=Disaggregation()))
    assert err.value.param == "kv_bytes_per_token"


def test_a_run_gives_up_once_too_many_requests_missed_an_slo() -> None:
    trace = [Arrival(i * 0.01, 64, 64) for i in range(2000)]  # 100 req/s on one replica of one sequence
    config = FleetConfig(startup_s=0, autoscaling=AutoscalingConfig(min_replicas=1, max_replicas=1))
    run = Fleet(_profile(0.01, max_num_seqs=1), config).run(trace, GiveUp(ttft_s=1.0, tpot_s=1.0))
    assert run.gave_up == "ttft"
    assert len(run.results) < 2000 and run.unfinished == 2000 - len(run.results)
    assert sum((r.ttft_s or 0) > 1.0 for r in run.results) == int(0.05 * 2000) + 1
