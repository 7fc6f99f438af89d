"""``bench pd``: the workload plan, the /metrics figures and their quantiles, the report, and one whole run.

The whole run starts a local Ray cluster and Serve, deploys the colocated
and then the disaggregated tiny app, and runs a few seconds of the workload
on each (under a minute on two cores).
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
from ray import serve

from cli.bench.metrics import histogram_quantile
from cli.bench.pd.bandwidth import Bandwidth
from cli.bench.pd.figures import PDFigures, parse_pd_figures
from cli.bench.pd.report import mode_report, parse_pd_slo, transfer_report
from cli.bench.pd.run import main as pd_main
from cli.bench.pd.workload import PDWorkload, WorkloadResult
from cli.bench.stats import ratio
from cli.bench.stream_client import RequestResult
from cli.main import build_parser, main
from cli.simulate.trace import read_jsonl
from cluster.metric_families import TRANSFER_BUCKETS
from cluster.metrics import ReplicaMetrics
from scheduling.errors import InvalidParameterError
from tests.shared_ray import SHARED

pytestmark = pytest.mark.ray  # on the session's shared cluster: run with the other Ray modules, last (tests/conftest.py)

MODE_KEYS = {"requests", "failed", "tpot_p50_ms", "tpot_p95_ms", "ttft_p95_ms", "long_ttft_p95_ms", "goodput",
             "goodput_fraction"}
TRANSFER_KEYS = {"remote_prefills", "prefill_retries", "kv_bytes_total", "kv_bytes_per_token", "kv_transfer_ms_p50",
                 "kv_transfer_ms_p95", "bandwidth_gb_s", "expected_transfer_ms"}


def test_the_plan_is_a_function_of_the_seed() -> None:
    plan = PDWorkload(streams=2, short_tokens=8, output_tokens=(4, 6), long_tokens=40, long_every_s=2.0,
                      duration_s=7.0, vocab=50, seed=3)
    assert replace(plan, duration_s=99.0).short_request(1, 5) == plan.short_request(1, 5)
    short = plan.short_request(0, 0)
    assert isinstance(short.prompt, list) and len(short.prompt) == 8 and 4 <= short.max_tokens <= 6
    assert all(0 <= t < 50 for t in short.prompt)
    assert short.endpoint == "/v1/completions"
    assert plan.short_request(0, 1).prompt != short.prompt and plan.short_request(1, 0).prompt != short.prompt
    long = plan.long_request(2)
    assert isinstance(long.prompt, list) and len(long.prompt) == 40 and long.max_tokens == plan.long_max_tokens
    assert plan.long_offsets() == [1.0, 3.0, 5.0]  # (k + 1/2) periods before 7 s
    assert PDWorkload(long_every_s=10.0, duration_s=55.0).long_offsets()[-1] == 45.0
    warm_short, warm_long = plan.warmup_requests()
    assert warm_short.prompt != short.prompt and warm_long.prompt != plan.long_request(0).prompt
    assert len(warm_long.prompt or []) == 40


@pytest.mark.parametrize(("field", "value", "param"), [
    ("streams", 0, "streams"), ("output_tokens", (1, 4), "output_tokens"), ("long_every_s", 0.0, "long_every_s"),
    ("duration_s", -1.0, "duration_s"), ("long_tokens", 16, "long_tokens")])
def test_the_plan_refuses_bad_settings(field: str, value: object, param: str) -> None:
    with pytest.raises(InvalidParameterError) as info:
        PDWorkload(**{"short_tokens": 32, field: value})  # type: ignore[arg-type]
    assert info.value.param == param


def test_histogram_quantile_interpolates_like_prometheus() -> None:
    inf = math.inf
    buckets = ((0.01, 2.0), (0.02, 6.0), (0.05, 10.0), (inf, 10.0))
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.01 + 0.01 * (5 - 2) / 4)
    assert histogram_quantile(0.1, buckets) == pytest.approx(0.005)  # 0 below the first bound
    assert histogram_quantile(1.0, buckets) == pytest.approx(0.05)
    # A rank in the +Inf bucket: the highest finite bound.
    assert histogram_quantile(0.95, ((0.01, 1.0), (inf, 10.0))) == 0.01
    assert histogram_quantile(0.5, ((0.01, 0.0), (inf, 0.0))) is None
    assert histogram_quantile(0.5, ()) is None
    with pytest.raises(ValueError):
        histogram_quantile(1.5, buckets)


def test_figures_from_a_replicas_metrics_and_their_change() -> None:
    metrics = ReplicaMetrics("m", "r1", export_to_ray=False)
    before = parse_pd_figures(metrics.render().decode())
    assert (before.remote_prefills, before.kv_bytes, before.transfer_count) == (0.0, 0.0, 0.0)
    for seconds in (0.004, 0.004, 0.03, 0.2):
        metrics.record("pd_remote_prefills", 1)
        metrics.record("pd_kv_transfer_bytes", 1000)
        metrics.record("pd_kv_transfer_seconds", seconds)
    metrics.record("pd_prefill_retries", 1)
    after = parse_pd_figures(metrics.render().decode())
    moved = after.minus(before)
    assert (moved.remote_prefills, moved.prefill_retries, moved.kv_bytes) == (4.0, 1.0, 4000.0)
    assert moved.transfer_count == 4.0 and moved.transfer_sum_s == pytest.approx(0.238)
    assert [le for le, _ in moved.transfer_buckets] == [*TRANSFER_BUCKETS, math.inf]
    assert dict(moved.transfer_buckets)[0.005] == 2.0 and moved.transfer_buckets[-1][1] == 4.0
    # Two of four at or below 5 ms: the median is the first bucket's top (2 ms .. 5 ms, rank 2 of 2).
    assert histogram_quantile(0.5, moved.transfer_buckets) == pytest.approx(0.005)


def ok(ttft_s: float, e2e_s: float, tokens: int) -> RequestResult:
    return RequestResult(ok=True, ttft_s=ttft_s, e2e_s=e2e_s, output_tokens=tokens, prompt_tokens=8,
                         finish_reasons=["length"])


def test_mode_report_keeps_stream_tpot_apart_and_counts_goodput() -> None:
    short = [ok(0.1, 0.1 + 0.02 * 10, 11), ok(0.1, 0.1 + 0.2 * 10, 11)]  # TPOT 20 ms and 200 ms
    long = [ok(3.0, 3.1, 2)]  # TPOT 100 ms, not a stream's
    failed = RequestResult(ok=False, error="HTTP 503: prefill pool")
    report = mode_report(WorkloadResult(short=[*short, failed], long=long, duration_s=10.0),
                         parse_pd_slo(["ttft_ms=2000,tpot_ms=100"]))
    assert set(report) >= MODE_KEYS
    assert (report["requests"], report["long_requests"], report["failed"]) == (4, 1, 1)
    assert report["tpot_p50_ms"] == pytest.approx(110.0) and report["tpot_p95_ms"] == pytest.approx(191.0)
    assert report["long_ttft_p95_ms"] == pytest.approx(3000.0)
    assert report["good_requests"] == 1  # the 20 ms stream; 200 ms TPOT, 3 s TTFT and the failure miss
    assert report["goodput"] == pytest.approx(0.1) and report["goodput_fraction"] == pytest.approx(0.25)
    assert report["errors"] == {"HTTP 503: prefill pool": 1}


def test_slo_forms_and_ratio() -> None:
    assert parse_pd_slo(["ttft:2000", "tpot:100"]) == parse_pd_slo(["ttft_ms=2000,tpot_ms=100"]) == \
        {"ttft": 2000.0, "tpot": 100.0}
    with pytest.raises(InvalidParameterError) as info:
        parse_pd_slo(["latency_ms=5"])
    assert info.value.param == "slo"
    with pytest.raises(InvalidParameterError):
        parse_pd_slo([","])
    assert ratio(3.0, 4.0) == 0.75 and ratio(None, 4.0) is None and ratio(1.0, 0.0) is None


def test_transfer_report_sets_the_measured_time_beside_the_arithmetic() -> None:
    buckets = ((0.01, 1.0), (0.02, 2.0), (math.inf, 2.0))
    moved = PDFigures(remote_prefills=2, kv_bytes=2 * 128 * 4096, transfer_buckets=buckets, transfer_count=2,
                      transfer_sum_s=0.025)
    bandwidth = Bandwidth(num_bytes=10**9, seconds=1.0, runs=5)  # 1 GB/s
    out = transfer_report(moved, long_tokens=128, bandwidth=bandwidth)
    assert set(out) >= TRANSFER_KEYS
    assert out["kv_bytes_per_token"] == 4096.0 and out["kv_bytes_total"] == 2 * 128 * 4096
    assert out["expected_transfer_ms"] == pytest.approx(128 * 4096 / 1e9 * 1e3, abs=1e-3)
    assert out["kv_transfer_ms_p50"] == pytest.approx(10.0) and out["kv_transfer_ms_p95"] == pytest.approx(19.0)
    assert out["kv_transfer_ms_mean"] == pytest.approx(12.5)
    none = transfer_report(PDFigures(), long_tokens=128, bandwidth=None)
    assert none["kv_bytes_per_token"] is None and none["expected_transfer_ms"] is None
    assert none["kv_transfer_ms_p50"] is None


def test_settings_that_would_not_compare_what_is_described_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["bench", "pd", "--model", "tiny", "--cores", "2"]
    assert main([*base, "--remote-prefill-min-tokens", "16", "--short-tokens", "32"]) == 2
    assert "remote_prefill_min_tokens" in capsys.readouterr().err
    assert main([*base, "--cores", "1"]) == 2
    assert "cores" in capsys.readouterr().err
    assert main([*base, "--long-tokens", "4096", "--max-model-len", "4096"]) == 2
    assert "max_model_len" in capsys.readouterr().err
    assert main([*base, "--num-kv-pages", "8"]) == 2
    assert "num_kv_pages" in capsys.readouterr().err
    args = build_parser().parse_args(["bench", "pd", "--model", "tiny"])
    assert (args.streams, args.long_tokens, args.remote_prefill_min_tokens) == (4, 2048, 512)


def test_a_whole_run_prints_both_modes(ray_cluster: None, tiny_model_dir: Path, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    # On the session's cluster (its Serve port), the command's apps beside the shared ones; on its own the
    # command starts a private cluster (cli.bench.harness.serve_on).
    args = build_parser().parse_args([
        "bench", "pd", "--model", str(tiny_model_dir), "--json", "--cores", "2", "--streams", "2",
        "--duration-s", "3", "--long-every-s", "1", "--long-tokens", "128", "--long-max-tokens", "4",
        "--remote-prefill-min-tokens", "64", "--short-tokens", "16", "--output-tokens", "4", "8",
        "--max-model-len", "256", "--num-kv-pages", "128", "--num-cpus", "4", "--bandwidth-runs", "2",
        "--trace-out", str(tmp_path / "sent")])
    SHARED.serve_url()
    assert SHARED.serve_port is not None
    rc = pd_main(args, serve_port=SHARED.serve_port)
    assert rc == 0
    assert not {"bench-pd-colocated", "bench-pd-disaggregated"} & set(serve.status().applications)  # deleted
    out = json.loads(capsys.readouterr().out)  # stdout holds the JSON alone
    for mode in ("colocated", "disaggregated"):
        assert set(out[mode]) >= MODE_KEYS, mode
        assert out[mode]["failed"] == 0, out[mode]["errors"]
        assert out[mode]["long_requests"] == 3 and out[mode]["tpot_p95_ms"] is not None
    dis = out["disaggregated"]
    assert set(dis) >= TRANSFER_KEYS
    assert dis["remote_prefills"] == 3 and dis["prefill_retries"] == 0  # the three long prompts, not the streams
    assert dis["kv_bytes_per_token"] == 4096.0  # tiny: 2 (K, V) x 4 layers x 4 KV heads x 32 dims x 4 bytes
    assert dis["kv_transfer_ms_p50"] is not None and dis["expected_transfer_ms"] > 0
    assert out["tpot_p95_ratio"] is not None and out["goodput_ratio"] is not None
    for mode in ("colocated", "disaggregated"):  # what each mode sent, as simulate reads it
        sent = read_jsonl(tmp_path / f"sent_{mode}.jsonl")
        assert len(sent) == out[mode]["requests"] and sent == sorted(sent, key=lambda a: a.t)
        assert sum(a.prompt_tokens == 128 and a.output_tokens == 4 for a in sent) == 3  # the long prompts
        assert all(a.prompt_tokens == 16 and 4 <= a.output_tokens <= 8 for a in sent if a.prompt_tokens != 128)
