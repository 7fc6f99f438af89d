"""``bench autoscale`` pieces without a server: arrivals, summary arithmetic, workload, CLI, plot."""

from __future__ import annotations

from pathlib import Path

import pytest

from cli.bench.autoscale.plot import plot_timeline
from cli.bench.autoscale.profile import (
    Phase,
    RequestRecord,
    RunResult,
    Sample,
    arrival_times,
    default_profile,
    samples_json,
    summarize,
)
from cli.bench.autoscale.routing import HEADER_CHARS, build_workload
from cli.main import build_parser


def test_arrivals_follow_the_rate_integral() -> None:
    profile = [Phase("idle", 2, 0, 0), Phase("ramp", 4, 0, 2), Phase("plateau", 3, 2, 2)]
    times = arrival_times(profile)
    assert len(times) == round(0 + 4 * 1 + 3 * 2)  # area under the rate
    assert times == sorted(times) and all(2.0 < t <= 9.0 for t in times)
    assert sum(1 for t in times if t > 6) == 6  # the plateau's 2 req/s for 3 s
    assert arrival_times(profile) == times  # deterministic
    phases = default_profile(3.0, idle_s=1, ramp_s=2, plateau_s=3, burst_s=1, cooldown_s=4)
    assert [p.name for p in phases] == ["idle", "ramp", "plateau", "burst", "idle"]
    assert phases[3].start_rps == 6.0


def sample(t: float, replicas: int, changing: int = 0) -> Sample:
    return Sample(t=t, offered_rps=1, replicas=replicas, replicas_changing=changing, in_flight=0, queued=0,
                  ttft_p95_ms=None, tpot_p95_ms=None, good=0, finished=0)


def test_summary_counts_goodput_breach_and_replica_seconds() -> None:
    fast = RequestRecord(sent=0.0, first_token=0.1, done=1.1, num_tokens=11, ok=True)
    slow_first = RequestRecord(sent=1.0, first_token=4.0, done=5.0, num_tokens=11, ok=True)
    failed = RequestRecord(sent=2.0, error="HTTP 500")
    samples = [sample(1, 1), sample(2, 1), sample(3, 1, 2), sample(4, 3), sample(5, 3), sample(6, 3, 2),
               sample(7, 1), sample(8, 1)]
    result = RunResult(samples=samples, records=[fast, slow_first, failed])
    out = summarize(result, slo_ttft_ms=1000, slo_tpot_ms=200, min_replicas=1, load_end_s=5)
    assert (out["num_requests"], out["failed_requests"], out["good_requests"]) == (3, 1, 1)
    assert out["first_errors"] == ["HTTP 500"]
    assert out["goodput_rps"] == pytest.approx(1 / 8)
    assert out["replica_seconds"] == 14 and out["peak_replicas"] == 3 and out["final_replicas"] == 1
    assert out["held_replica_seconds"] == 14 + 2 + 2  # the starting and the stopping ones too
    assert out["first_breach_s"] == 2.0  # sent at 1 s, no first token by 1 s + 1000 ms
    assert (out["replicas_ge_3_at_s"], out["scale_up_s_after_breach"]) == (4, 2.0)
    assert (out["back_to_min_at_s"], out["scale_down_s_after_load"]) == (7, 2.0)
    assert samples_json(result)[0]["replicas"] == 1


def test_routing_workloads() -> None:
    prefix = build_workload("prefix", groups=3, per_group=2, prefix_chars=300, suffix_chars=10)
    assert len(prefix) == 6
    assert [p[:7] for p, _ in prefix[:4]] == ["[doc 0]", "[doc 1]", "[doc 2]", "[doc 0]"]  # interleaved
    for prompt, header in prefix:
        assert header is not None and len(header) == HEADER_CHARS and prompt.startswith(header)
    assert len({p for p, _ in prefix}) == 6  # every question is distinct
    unique = build_workload("unique", groups=3, per_group=2, prefix_chars=300, suffix_chars=10)
    assert all(h is None for _, h in unique) and len({p[:50] for p, _ in unique}) == 6


def test_cli_parses_a_short_profile() -> None:
    args = build_parser().parse_args(["bench", "autoscale", "--policy", "default", "--json", "--ramp-s", "2",
                                      "--url", "http://127.0.0.1:1"])
    assert (args.policy, args.json, args.ramp_s, args.mode) == ("default", True, 2.0, "autoscale")
    routing = build_parser().parse_args(["bench", "autoscale", "--mode", "routing", "--router", "prefix"])
    assert (routing.router, routing.groups, routing.per_group, routing.prefix_chars) == ("prefix", 8, 64, 512)


def test_timeline_png(tmp_path: Path) -> None:
    samples = samples_json(RunResult(samples=[sample(1, 1), sample(2, 2), sample(3, 3)]))
    out = plot_timeline({"a": samples, "b": samples}, tmp_path / "t.png", slo_ttft_ms=100, slo_tpot_ms=10)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
