"""``flotilla bench serve``: datasets, arrivals, statistics, comparison, the SSE client, and one live run."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import statistics
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from cli.bench.serve.arrivals import ArrivalConfig, arrival_offsets, parse_rates
from cli.bench.serve.compare import COMPARED, compare
from cli.bench.serve.config import ServeBenchConfig, bench_config, resolve_settings
from cli.bench.serve.datasets import DatasetConfig, build_requests
from cli.bench.serve.server import parse_flotilla_metrics
from cli.bench.stats import parse_slo, summarize
from cli.bench.stream_client import RequestResult, stream_request
from cli.bench.workload import BenchRequest
from cli.main import main
from scheduling.errors import InvalidParameterError

pytestmark = pytest.mark.ray  # on the session's shared cluster: run with the other Ray modules, last (tests/conftest.py)


# ------------------------------------------------------------------ datasets
def test_random_dataset_lengths_vocab_and_seed() -> None:
    cfg = DatasetConfig(num_prompts=50, input_len=(5, 9), output_len=(2, 4), vocab=17, seed=3)
    reqs = build_requests(cfg)
    assert len(reqs) == 50
    for r in reqs:
        assert isinstance(r.prompt, list) and 5 <= len(r.prompt) <= 9
        assert all(0 <= t < 17 for t in r.prompt) and 2 <= r.max_tokens <= 4
        assert r.endpoint == "/v1/completions" and r.num_prompt_tokens == len(r.prompt)
    assert build_requests(cfg) == reqs
    assert build_requests(DatasetConfig(num_prompts=50, input_len=(5, 9), output_len=(2, 4), vocab=17, seed=4)) != reqs
    text = build_requests(DatasetConfig(num_prompts=3, input_len=(20, 20), prompt_format="text"))
    assert all(isinstance(r.prompt, str) and len(r.prompt) == 20 for r in text)


def test_shared_prefix_groups_share_their_prefix_only() -> None:
    cfg = DatasetConfig(name="shared-prefix", num_groups=3, prompts_per_group=4, prefix_len=16, input_len=(4, 8))
    reqs = build_requests(cfg)
    assert len(reqs) == 12
    prompts = [r.prompt for r in reqs]
    assert all(isinstance(p, list) for p in prompts)
    prefix = [p[:16] for p in prompts]  # type: ignore[index]
    for i in range(12):  # interleaved: request i is in group i % 3
        assert prefix[i] == prefix[i % 3]
    assert len({tuple(p) for p in prefix}) == 3


def test_multi_turn_history_grows_turn_by_turn() -> None:
    cfg = DatasetConfig(name="multi-turn", num_conversations=2, num_turns=3, input_len=(5, 10), output_len=(3, 6))
    reqs = build_requests(cfg)
    assert len(reqs) == 6 and all(r.endpoint == "/v1/chat/completions" for r in reqs)
    for k in range(3):
        for c in range(2):
            msgs = reqs[k * 2 + c].messages
            assert msgs is not None and len(msgs) == 2 * k + 1 and msgs[-1]["role"] == "user"
            if k:
                earlier = reqs[(k - 1) * 2 + c].messages
                assert earlier is not None and msgs[: len(earlier)] == earlier  # the same conversation


def test_chat_dataset_sends_real_text_of_varied_length() -> None:
    cfg = DatasetConfig(name="chat", num_prompts=64, output_len=(64, 256), seed=0)
    reqs = build_requests(cfg)
    assert len(reqs) == 64 and build_requests(cfg) == reqs
    assert build_requests(DatasetConfig(name="chat", num_prompts=64, seed=1)) != reqs
    contents = []
    for r in reqs:
        assert r.endpoint == "/v1/chat/completions" and r.messages is not None and len(r.messages) == 1
        assert r.messages[0]["role"] == "user" and 64 <= r.max_tokens <= 256
        contents.append(r.messages[0]["content"])
    quoting = [c for c in contents if c.count("\n\n") >= 1]
    assert 0.4 < len(quoting) / len(contents) < 0.9  # about two thirds quote passages, the rest are short asks
    lengths = sorted(len(c) for c in contents)
    assert lengths[0] < 80 and lengths[-1] > 1200  # ~20 to ~400 tokens with a chat template
    assert all(c.isascii() and len(c.split()) >= 4 for c in contents)  # sentences, not ids


def test_jsonl_dataset_reads_the_workload_format(tmp_path: Path) -> None:
    path = tmp_path / "w.jsonl"
    path.write_text("\n".join(json.dumps({"prompt_token_ids": [i, i + 1, 2], "max_tokens": i + 1})
                              for i in range(5)) + "\n")
    reqs = build_requests(DatasetConfig(name="jsonl", path=str(path), num_prompts=3))
    assert [(r.prompt, r.max_tokens) for r in reqs] == [([0, 1, 2], 1), ([1, 2, 2], 2), ([2, 3, 2], 3)]
    path.write_text('{"prompt_token_ids": [1], "max_tokens": 0}\n')
    with pytest.raises(InvalidParameterError) as info:
        build_requests(DatasetConfig(name="jsonl", path=str(path)))
    assert info.value.param == "workload" and ":1:" in str(info.value)


def test_dataset_config_errors_name_the_parameter() -> None:
    for kwargs, param in (({"name": "sharegpt"}, "dataset"), ({"input_len": (9, 3)}, "input_len"),
                          ({"num_turns": 0}, "num_turns"), ({"name": "jsonl"}, "dataset_path")):
        with pytest.raises(InvalidParameterError) as info:
            DatasetConfig(**kwargs)
        assert info.value.param == param


# ------------------------------------------------------------------ arrivals
def _gaps(rate: float, burstiness: float, n: int = 4000) -> list[float]:
    t = arrival_offsets(n, ArrivalConfig(rate, burstiness, seed=1))
    assert t[0] == 0.0 and all(a <= b for a, b in zip(t, t[1:], strict=False))
    return [b - a for a, b in zip(t, t[1:], strict=False)]


def test_arrivals_have_the_rate_and_burstiness_asked_for() -> None:
    for burstiness, cv in ((1.0, 1.0), (0.25, 2.0), (4.0, 0.5)):
        gaps = _gaps(10.0, burstiness)
        mean = statistics.fmean(gaps)
        assert mean == pytest.approx(0.1, rel=0.08)
        assert statistics.pstdev(gaps) / mean == pytest.approx(cv, rel=0.15)  # gamma: CV = 1/sqrt(shape)
    assert arrival_offsets(5, ArrivalConfig()) == [0.0] * 5
    assert arrival_offsets(9, ArrivalConfig(3.0, seed=2)) == arrival_offsets(9, ArrivalConfig(3.0, seed=2))
    assert parse_rates("1, 2.5,inf") == [1.0, 2.5, math.inf] and parse_rates([4]) == [4.0]
    for bad, param in (("0", "request_rate"), ("x", "request_rate")):
        with pytest.raises(InvalidParameterError) as info:
            parse_rates(bad)
        assert info.value.param == param
    with pytest.raises(InvalidParameterError) as info:
        ArrivalConfig(1.0, max_concurrency=0)
    assert info.value.param == "max_concurrency"


# --------------------------------------------------------------------- stats
def test_summary_percentiles_throughput_and_goodput() -> None:
    results = [RequestResult(ok=True, ttft_s=0.1 * (i + 1), e2e_s=0.1 * (i + 1) + 0.9, itl_s=[0.1] * 9,
                             prompt_tokens=20, output_tokens=10, finish_reasons=["length"]) for i in range(10)]
    results.append(RequestResult(ok=False, error="HTTP 500: boom"))
    s = summarize(results, 2.0, parse_slo(["ttft:500", "tpot:150"]))
    assert (s["successful_requests"], s["failed_requests"], s["errors"]) == (10, 1, {"HTTP 500: boom": 1})
    assert s["request_throughput"] == 5.0 and s["output_throughput"] == 50.0 and s["total_token_throughput"] == 150.0
    assert s["ttft_ms"]["p50"] == pytest.approx(550.0) and s["ttft_ms"]["mean"] == pytest.approx(550.0)
    assert s["ttft_ms"]["p95"] == pytest.approx(955.0) and s["tpot_ms"]["p99"] == pytest.approx(100.0)
    assert s["itl_ms"]["p50"] == pytest.approx(100.0) and s["usage_reported"] is True
    # ttft <= 500 ms: the first five; all have tpot 100 ms
    assert s["goodput"]["good_requests"] == 5 and s["goodput"]["request_throughput"] == 2.5
    assert summarize([], 1.0, {})["ttft_ms"]["p50"] is None
    for bad in (["ttft=5"], ["foo:5"], ["ttft:-1"], ["tpot:x"]):
        with pytest.raises(InvalidParameterError) as info:
            parse_slo(bad)
        assert info.value.param == "slo"


def _result(tpot_p95: float, throughput: float, ttft_p95: float = 100.0) -> dict[str, Any]:
    return {"runs": [{"request_rate": 4.0, "request_throughput": throughput, "output_throughput": throughput * 10,
                      "ttft_ms": {"p50": 50.0, "p95": ttft_p95}, "tpot_ms": {"p50": 5.0, "p95": tpot_p95},
                      "e2e_ms": {"p95": 900.0}}]}


def test_compare_exit_code_gates_on_tpot_p95_and_throughput(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = tmp_path / "base.json"
    base.write_text(json.dumps(_result(10.0, 4.0)))
    cases = [(_result(10.3, 3.9, ttft_p95=300.0), 0),  # within 5%; TTFT does not gate
             (_result(10.6, 4.0), 1),  # TPOT P95 +6%
             (_result(9.0, 3.7), 1),  # throughput -7.5%
             (_result(9.0, 5.0), 0)]  # better
    for i, (new, code) in enumerate(cases):
        path = tmp_path / f"new{i}.json"
        path.write_text(json.dumps(new))
        assert main(["bench", "serve", "--load", str(path), "--compare", str(base)]) == code, new
        err = capsys.readouterr().err
        assert "tpot_p95_ms" in err and ("REGRESSED" in err) == bool(code)
    rows, regressed = compare(_result(10.0, 4.0), _result(11.0, 4.0), threshold=0.2)
    assert not regressed and len(rows) == len(COMPARED) == 9
    assert {r["metric"] for r in rows} >= {"itl_p50_ms", "itl_p90_ms"}  # absent from these runs: reported, not gated


def test_config_file_then_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "run.yaml"
    cfg.write_text("dataset: shared-prefix\nnum_groups: 2\nrequest_rate: [1, 2]\nslo: {ttft: 300}\n"
                   "max_concurrency: 3\n")
    settings = resolve_settings({"config": str(cfg), "request_rate": "inf", "base_url": "http://h:1/"})
    bench = bench_config(settings)
    assert bench.dataset.name == "shared-prefix" and bench.dataset.num_groups == 2
    assert bench.request_rates == (math.inf,) and bench.base_url == "http://h:1"
    assert bench.slo_ms == {"ttft": 300.0} and bench.max_concurrency == 3
    cfg.write_text("request_rates: 4\n")  # a typo is an error, not ignored
    assert main(["bench", "serve", "--config", str(cfg)]) == 2
    assert "request_rates" in capsys.readouterr().err


def test_flotilla_metrics_are_parsed_per_replica() -> None:
    text = ('# TYPE flotilla:memory_peak_bytes gauge\n'
            'flotilla:memory_peak_bytes{model_name="m",replica="r1"} 5.0\n'
            '# TYPE flotilla:process_cpu_seconds counter\n'
            'flotilla:process_cpu_seconds_total{model_name="m",replica="r1"} 2.0\n'
            '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 1.0\n')
    assert parse_flotilla_metrics(text) == {"r1": {"memory_peak_bytes": 5.0, "process_cpu_seconds_total": 2.0}}


# ---------------------------------------------------------------- SSE client
async def _fake_server() -> tuple[web.AppRunner, str]:
    """A loopback server speaking just enough of the OpenAI streaming API."""

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        mode = body["prompt"]
        if mode == "500":
            return web.json_response({"error": {"message": "boom"}}, status=500)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        # an empty chunk brings output only when it finishes (held-back text)
        for text, finish in (("a", None), ("", None), ("b", None), ("", "length")):
            choice = {"text": text, "finish_reason": finish}
            await resp.write(b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n")
        if mode == "error":
            await resp.write(b'data: {"error": {"message": "engine failed"}}\n\n')
        elif mode == "usage":
            await resp.write(b'data: {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 5}}\n\n')
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


def test_sse_client_times_chunks_and_reads_usage_or_errors() -> None:
    async def scenario() -> dict[str, RequestResult]:
        runner, url = await _fake_server()
        try:
            async with aiohttp.ClientSession() as session:
                out = {}
                for mode in ("usage", "nousage", "error", "500"):
                    cfg = ServeBenchConfig()
                    body = BenchRequest(4, prompt=mode).body("m", temperature=cfg.temperature, ignore_eos=cfg.ignore_eos)
                    out[mode] = await stream_request(session, url + "/v1/completions", body)
                return out
        finally:
            await runner.cleanup()

    r = asyncio.run(scenario())
    ok = r["usage"]
    assert ok.ok and (ok.prompt_tokens, ok.output_tokens) == (7, 5)
    assert ok.ttft_s is not None and ok.e2e_s is not None and len(ok.itl_s) == 2  # a, b and the finish
    assert ok.tpot_s == pytest.approx((ok.e2e_s - ok.ttft_s) / 4)
    # Tokens are never counted from chunks: a stream without usage is a failed request.
    no_usage = r["nousage"]
    assert not no_usage.ok and no_usage.error is not None and "usage" in no_usage.error
    assert not r["error"].ok and r["error"].error == "engine failed"
    assert not r["500"].ok and r["500"].error is not None and r["500"].error.startswith("HTTP 500")
    cfg = ServeBenchConfig()
    body = BenchRequest(4, messages=[{"role": "user", "content": "hi"}]).body(
        "m", temperature=cfg.temperature, ignore_eos=cfg.ignore_eos)
    assert body["stream_options"] == {"include_usage": True} and body["ignore_eos"] and "prompt" not in body


# ---------------------------------------------------------------------- live
@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Any:
    """The session's tiny app (``shared_tiny``)."""
    from tests.serve_harness import shared_tiny

    return shared_tiny(tiny_model_dir)


def test_live_run_through_the_cli(server: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "run.yaml"
    cfg.write_text("dataset: random\nnum_prompts: 8\ninput_len: [8, 24]\noutput_len: [4, 8]\n"
                   "request_rate: 50\nmax_concurrency: 4\nslo: [ttft:60000, tpot:60000]\nnum_warmups: 1\n")
    out = tmp_path / "result.json"
    args = ["bench", "serve", "--config", str(cfg), "--base-url", server.url, "--out", str(out)]
    plot = tmp_path / "result.png"
    have_matplotlib = importlib.util.find_spec("matplotlib") is not None  # the optional bench extra
    if have_matplotlib:
        args += ["--plot", str(plot)]
    assert main(args) == 0
    printed = json.loads(capsys.readouterr().out)
    result = json.loads(out.read_text())
    assert printed["model"] == result["model"] == "tiny" and result["server"] == "flotilla"
    run = result["runs"][0]
    expected = sum(r.max_tokens for r in build_requests(bench_config(resolve_settings({"config": str(cfg)})).dataset))
    assert (run["successful_requests"], run["failed_requests"], run["num_requests"]) == (8, 0, 8)
    assert run["usage_reported"] and run["total_output_tokens"] == expected  # ignore_eos: every token asked for
    assert run["request_rate"] == 50.0 and run["max_concurrency"] == 4 and run["duration_s"] > 0
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(run[key]) == {"mean", "p50", "p90", "p95", "p99"} and run[key]["p50"] > 0
        assert run[key]["p50"] <= run[key]["p90"] <= run[key]["p95"] <= run[key]["p99"]
    headline = run["headline"]
    assert (headline["itl_ms_p50"], headline["itl_ms_p90"]) == (run["itl_ms"]["p50"], run["itl_ms"]["p90"])
    assert printed["runs"][0]["headline"]["itl_ms_p90"] == headline["itl_ms_p90"]
    assert run["ttft_ms"]["p50"] <= run["e2e_ms"]["p50"]
    assert run["goodput"]["good_requests"] == 8
    assert run["server_metrics"]["peak_memory_bytes"] > 0 and run["server_metrics"]["memory_limit_bytes"] > 0
    assert run["headline"]["peak_memory_bytes"] == run["server_metrics"]["peak_memory_bytes"]
    steps, forward_ms = run["server_metrics"]["engine_steps"], run["server_metrics"]["engine_forward_ms_per_step"]
    assert steps >= max(r.max_tokens for r in build_requests(bench_config(resolve_settings({"config": str(cfg)})).dataset))
    assert 0 < forward_ms * steps < run["duration_s"] * 1e3  # the forwards fit inside the run
    assert len(run["samples"]["ttft_ms"]) == 8 and "samples" not in printed["runs"][0]
    assert not have_matplotlib or plot.read_bytes().startswith(b"\x89PNG")
    server.assert_pages_free()
