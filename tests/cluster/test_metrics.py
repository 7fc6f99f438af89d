"""Replica metrics: the exposition from synthetic deltas and stats, the dashboard's names, and a live server."""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, cast

import pytest
from prometheus_client.parser import text_string_to_metric_families

from actors.api import EngineStats, FinishReason, LatencyWindow, SequenceDelta, SequenceTiming
from actors.engine.stats import memory_usage, snapshot
from cluster import metrics as m
from cluster.metric_families import (
    CLUSTER_FAMILIES,
    REPLICA_FAMILIES,
    Family,
    exported_sample_names,
)
from cluster.metrics import ReplicaMetrics
from kvcache.page_allocator import PageAllocator
from scheduling.policy import BatchPolicy
from scheduling.scheduler_config import SchedulerConfig

pytestmark = pytest.mark.ray  # on the session's shared cluster: run with the other Ray modules, last (tests/conftest.py)

if TYPE_CHECKING:
    from actors.engine.llm_engine import LLMEngine

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "ray_configs" / "grafana_dashboard.json"
REQUIRED = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries",
            "prefix_cache_hits", "prompt_tokens", "generation_tokens", "request_success", "num_preemptions",
            "time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
            "request_queue_time_seconds", "memory_used_bytes", "memory_limit_bytes")


def samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``{(sample name, sorted labels without model/replica): value}`` of an exposition."""
    out = {}
    for fam in text_string_to_metric_families(text.decode()):
        for s in fam.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "replica")))
            out[(s.name, labels)] = s.value
    return out


def stats(**kw: Any) -> EngineStats:
    base: dict[str, Any] = dict(
        num_waiting=2, num_running=3, num_unfinished_requests=5, num_kv_pages_total=100,
        num_kv_pages_free=50, num_kv_pages_used=50, num_kv_pages_evictable=10, num_kv_pages_locked=4,
        prefix_cache_hit_rate=0.25, num_preemptions=1, num_steps=7, ttft_ms_p50=1.0, ttft_ms_p95=2.0,
        tpot_ms_p50=1.0, tpot_ms_p95=2.0, prefix_cache_queries_tokens=400, prefix_cache_hits_tokens=100,
        memory_used_bytes=1000, memory_peak_bytes=1500, memory_limit_bytes=8000, cpu_seconds_total=2.5)
    base.update(kw)
    return EngineStats(**base)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_deltas_become_tokens_latencies_and_finish_reasons() -> None:
    clock = Clock()
    rm = ReplicaMetrics("tiny", "r1", export_to_ray=False, clock=clock)
    rm.observe([SequenceDelta(request_id="a", index=0, token_ids=[5], text="x", logprobs=None, num_prompt_tokens=10),
                SequenceDelta(request_id="b", index=0, token_ids=[6], text="y", logprobs=None, num_prompt_tokens=7)])
    clock.now += 0.02
    rm.observe([SequenceDelta(request_id="a", index=0, token_ids=[7, 8], text="zz", logprobs=None,
                              num_prompt_tokens=10)])
    clock.now += 0.03
    done = SequenceTiming(arrival_time=1.0, first_token_time=1.5, last_token_time=2.5, num_output_tokens=5,
                          first_scheduled_time=1.25)
    rm.observe([SequenceDelta(request_id="a", index=0, token_ids=[9], text="w", logprobs=None,
                              finish_reason=FinishReason.LENGTH, num_prompt_tokens=10, timing=done),
                SequenceDelta(request_id="b", index=0, token_ids=[], text="", logprobs=None,
                              finish_reason=FinishReason.ABORT, num_prompt_tokens=7,
                              timing=SequenceTiming(1.0, 1.1, 1.1, 1, 1.05))])
    s = samples(rm.render())
    assert s[("flotilla:prompt_tokens_total", ())] == 17  # each request's prompt counted once
    assert s[("flotilla:generation_tokens_total", ())] == 5
    assert s[("flotilla:request_success_total", (("finished_reason", "length"),))] == 1
    assert s[("flotilla:request_success_total", (("finished_reason", "abort"),))] == 1
    assert s[("flotilla:request_success_total", (("finished_reason", "stop"),))] == 0
    # a: 2 tokens 20 ms after the first (10 ms each), then 1 token 30 ms later
    assert s[("flotilla:inter_token_latency_seconds_count", ())] == 3
    assert s[("flotilla:inter_token_latency_seconds_sum", ())] == pytest.approx(0.05)
    assert s[("flotilla:time_to_first_token_seconds_count", ())] == 2  # both produced a token
    assert s[("flotilla:time_to_first_token_seconds_sum", ())] == pytest.approx(0.6)
    assert s[("flotilla:request_queue_time_seconds_sum", ())] == pytest.approx(0.3)
    # end-to-end and TPOT only for sequences that ended normally
    assert s[("flotilla:e2e_request_latency_seconds_count", ())] == 1
    assert s[("flotilla:e2e_request_latency_seconds_sum", ())] == pytest.approx(1.5)
    assert s[("flotilla:request_time_per_output_token_seconds_sum", ())] == pytest.approx(0.25)
    assert s[("flotilla:time_to_first_token_seconds_bucket", (("le", "0.25"),))] == 1  # b's 0.1 s
    # An embedding: its prompt counts, it succeeds, and it has no first token (no TTFT sample).
    rm.observe([SequenceDelta(request_id="e", index=0, token_ids=[], text="", logprobs=None,
                              finish_reason=FinishReason.STOP, num_prompt_tokens=4,
                              timing=SequenceTiming(3.0, None, 3.2, 0, 3.1), embedding=[0.5, 0.5])])
    s = samples(rm.render())
    assert s[("flotilla:prompt_tokens_total", ())] == 21
    assert s[("flotilla:request_success_total", (("finished_reason", "stop"),))] == 1
    assert s[("flotilla:time_to_first_token_seconds_count", ())] == 2
    assert s[("flotilla:time_to_first_token_seconds_bucket", (("le", "0.5"),))] == 2  # and a's 0.5 s
    assert rm._last_token_at == {}  # finished sequences leave no state


def test_sequence_state_is_bounded() -> None:
    rm = ReplicaMetrics("tiny", "r1", export_to_ray=False, max_tracked=4)
    rm.observe([SequenceDelta(request_id=f"r{i}", index=0, token_ids=[1], text="x", logprobs=None, num_prompt_tokens=1)
                for i in range(10)])
    assert list(rm._last_token_at) == [(f"r{i}", 0) for i in range(6, 10)]


def test_engine_stats_become_gauges_and_counters() -> None:
    rm = ReplicaMetrics("tiny", "r1", export_to_ray=False)
    rm.update(stats())
    rm.update(stats(prefix_cache_queries_tokens=500, prefix_cache_hits_tokens=160, num_preemptions=3,
                    cpu_seconds_total=4.0, num_running=1, num_steps=41, forward_seconds_total=0.75))
    s = samples(rm.render())
    assert s[("flotilla:num_requests_running", ())] == 1
    assert s[("flotilla:num_requests_waiting", ())] == 2
    assert s[("flotilla:kv_cache_usage_perc", ())] == pytest.approx(0.4)  # evictable pages count as free
    assert s[("flotilla:prefix_cache_queries_total", ())] == 500
    assert s[("flotilla:prefix_cache_hits_total", ())] == 160
    assert s[("flotilla:num_preemptions_total", ())] == 3
    assert s[("flotilla:engine_steps_total", ())] == 41
    assert s[("flotilla:engine_forward_seconds_total", ())] == 0.75
    assert s[("flotilla:process_cpu_seconds_total", ())] == 4.0
    assert s[("flotilla:memory_peak_bytes", ())] == 1500
    assert s[("flotilla:memory_limit_bytes", ())] == 8000
    assert not any(name.startswith("flotilla:gpu") for name, _ in s)  # CPU: no GPU samples
    rm.update(stats(prefix_cache_queries_tokens=50, gpu_memory_used_bytes=7, gpu_memory_total_bytes=9,
                    gpu_utilization_perc=55.0))  # a restarted engine counts from zero again
    s = samples(rm.render())
    assert s[("flotilla:prefix_cache_queries_total", ())] == 550
    assert s[("flotilla:gpu_utilization_perc", ())] == 55.0
    assert s[("flotilla:gpu_memory_total_bytes", ())] == 9


def _spec_snapshot(scheduler: BatchPolicy, allocator: PageAllocator) -> EngineStats:
    """``snapshot`` of an engine that is only a real scheduler (no model: the counters are all it reads here)."""
    engine = SimpleNamespace(policy=scheduler, allocator=allocator, num_unfinished_requests=0,
                             forward_seconds_total=0.0, grammar=SimpleNamespace(compile_seconds=lambda: (0, ())),
                             constrained_requests={}, grammar_seconds_total=0.0,
                             loras=SimpleNamespace(requests={}, load_seconds={}, serving=lambda: []), kv_tiers=None)
    return snapshot(cast("LLMEngine", engine), LatencyWindow())


def test_structured_output_metrics_count_requests_and_compiles() -> None:
    rm = ReplicaMetrics("tiny", "r1", export_to_ray=False)
    rm.update(stats(structured_output_requests=(("json", 2), ("regex", 1)), structured_output_step_seconds=0.5,
                    grammar_compiles_total=2, grammar_compile_seconds_recent=(0.002, 0.2)))
    # Three more compiles, of which the snapshot still holds the last two it keeps (plus older ones).
    rm.update(stats(structured_output_requests=(("json", 5), ("regex", 1)), structured_output_step_seconds=0.75,
                    grammar_compiles_total=5, grammar_compile_seconds_recent=(0.002, 0.2, 0.003, 0.004, 3.0)))
    s = samples(rm.render())
    assert s[("flotilla:structured_output_requests_total", (("kind", "json"),))] == 5
    assert s[("flotilla:structured_output_requests_total", (("kind", "regex"),))] == 1
    assert s[("flotilla:structured_output_step_seconds_total", ())] == 0.75
    assert s[("flotilla:grammar_compile_seconds_count", ())] == 5
    assert s[("flotilla:grammar_compile_seconds_sum", ())] == pytest.approx(0.002 + 0.2 + 0.003 + 0.004 + 3.0)
    assert s[("flotilla:grammar_compile_seconds_bucket", (("le", "0.005"),))] == 3


def test_spec_decode_counters_go_from_the_scheduler_to_the_exposition(monkeypatch: pytest.MonkeyPatch) -> None:
    to_ray: list[tuple[str, float, dict[str, str]]] = []

    def ray_record(f: Family, value: float, tags: dict[str, str]) -> None:
        to_ray.append((f.name, value, tags))

    monkeypatch.setattr(m, "_ray_record", ray_record)
    allocator = PageAllocator(8)
    scheduler = BatchPolicy(SchedulerConfig(max_model_len=32, max_num_seqs=8, max_num_batched_tokens=32), allocator)
    rm = ReplicaMetrics("tiny", "r1", export_to_ray=True)
    s = samples(rm.render())
    assert s[("flotilla:spec_decode_num_drafts_total", ())] == 0  # a zero sample before any draft
    assert not any(name.startswith("flotilla:spec_decode_num_accepted_tokens_per_pos") for name, _ in s)

    for num_draft, num_accepted in ((3, 2), (3, 0), (2, 2)):
        scheduler.stats.record_draft(num_draft, num_accepted)
    first = _spec_snapshot(scheduler, allocator)
    assert (first.spec_decode_num_drafts, first.spec_decode_num_draft_tokens,
            first.spec_decode_num_accepted_tokens, first.spec_decode_num_accepted_tokens_per_pos) == (3, 8, 4, (2, 2, 0))
    rm.update(first)
    scheduler.stats.record_draft(3, 3)
    rm.update(_spec_snapshot(scheduler, allocator))
    rm.update(_spec_snapshot(scheduler, allocator))  # nothing new: nothing added

    s = samples(rm.render())
    assert s[("flotilla:spec_decode_num_drafts_total", ())] == 4
    assert s[("flotilla:spec_decode_num_draft_tokens_total", ())] == 11
    assert s[("flotilla:spec_decode_num_accepted_tokens_total", ())] == 7
    per_pos = {labels: v for (name, labels), v in s.items()
               if name == "flotilla:spec_decode_num_accepted_tokens_per_pos_total"}
    assert per_pos == {(("position", "0"),): 3, (("position", "1"),): 3, (("position", "2"),): 1}
    # Ray gets the same increments, the position as a tag.
    ray_per_pos: dict[str, float] = {}
    for name, value, tags in to_ray:
        if name == "spec_decode_num_accepted_tokens_per_pos":
            assert tags.keys() == {"model_name", "replica", "position"}
            ray_per_pos[tags["position"]] = ray_per_pos.get(tags["position"], 0.0) + value
    assert ray_per_pos == {"0": 3, "1": 3, "2": 1}
    assert sum(v for name, v, _ in to_ray if name == "spec_decode_num_draft_tokens") == 11

    # A restarted engine counts from zero again, per position too.
    rm.update(stats(spec_decode_num_drafts=1, spec_decode_num_draft_tokens=3, spec_decode_num_accepted_tokens=1,
                    spec_decode_num_accepted_tokens_per_pos=(1, 0, 0)))
    s = samples(rm.render())
    assert s[("flotilla:spec_decode_num_drafts_total", ())] == 5
    assert s[("flotilla:spec_decode_num_accepted_tokens_per_pos_total", (("position", "0"),))] == 4
    assert s[("flotilla:spec_decode_num_accepted_tokens_per_pos_total", (("position", "2"),))] == 1


def test_reporting_task_refreshes_from_the_engine() -> None:
    async def scenario() -> bytes:
        rm = ReplicaMetrics("tiny", "r1", export_to_ray=False)
        calls: list[int] = []
        second = asyncio.Event()

        async def fetch() -> EngineStats:
            calls.append(1)
            if len(calls) == 1:
                raise ConnectionError("engine down")  # a failed refresh keeps the task alive
            second.set()
            return stats(num_waiting=9)

        rm.start_reporting(fetch, interval_s=0.001)
        rm.start_reporting(fetch, interval_s=0.001)  # idempotent: still one task
        await asyncio.wait_for(second.wait(), 10.0)
        rm.stop_reporting()
        return rm.render()

    assert samples(asyncio.run(scenario()))[("flotilla:num_requests_waiting", ())] == 9


def test_memory_usage_of_this_process() -> None:
    mem = memory_usage()
    assert 0 < mem.used_bytes <= mem.peak_bytes < mem.limit_bytes
    assert mem.cpu_seconds > 0


def test_scaling_decisions_never_raise() -> None:
    m.record_scaling_decision("LLMServer", 1, 3, "queue")
    decision = m.last_scaling_decision("LLMServer")
    assert decision is not None and (decision.current_replicas, decision.target_replicas) == (1, 3)
    m.record_scaling_decision("LLMServer", "x", None, "bad input")  # type: ignore[arg-type]
    assert m.last_scaling_decision("LLMServer") == decision


def _dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [v["query"]["query"] for v in dash["templating"]["list"] if isinstance(v.get("query"), dict)]
    return exprs


def test_dashboard_is_valid_and_plots_only_exported_names() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["title"] and dash["panels"] and all(p["targets"] for p in dash["panels"])
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    referenced = {n for e in _dashboard_exprs() for n in re.findall(r"\b(?:ray_)?flotilla[_:][a-z0-9_]+", e)}
    assert referenced and referenced <= exported_sample_names(), referenced - exported_sample_names()
    families = {f.name for f in REPLICA_FAMILIES + CLUSTER_FAMILIES}
    plotted = {f for f in families if any(f"flotilla_{f}" in n for n in referenced)}
    assert plotted == families  # every exported family has a panel


def test_live_server_exposes_every_family(tiny_model_dir: Path) -> None:
    import ray

    from tests.serve_harness import http, shared_tiny

    # The session's tiny app (earlier tests may have used it): its counters are read as changes over this test.
    server = shared_tiny(tiny_model_dir)
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=30) as resp:
        before = samples(resp.read())
    completion_tokens = 0
    for i in range(3):
        status, body = http(f"{server.url}/v1/completions",
                            {"model": "tiny", "prompt": f"hello {i}", "max_tokens": 4, "ignore_eos": True})
        assert status == 200, body
        completion_tokens += body["usage"]["completion_tokens"]
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=30) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read()
    s = samples(text)

    def moved(key: tuple[str, tuple[tuple[str, str], ...]]) -> float:
        return s[key] - before.get(key, 0.0)

    names = {name for name, _ in s}
    for fam in REQUIRED:
        assert any(n.startswith(f"flotilla:{fam}") for n in names), fam
    assert moved(("flotilla:generation_tokens_total", ())) == completion_tokens == 12
    assert moved(("flotilla:request_success_total", (("finished_reason", "length"),))) == 3
    assert moved(("flotilla:time_to_first_token_seconds_count", ())) == 3
    assert s[("flotilla:memory_used_bytes", ())] > 0
    # The same figures reach Ray's one Prometheus endpoint (pushed every few seconds).
    port = ray.nodes()[0]["MetricsExportPort"]
    deadline = time.monotonic() + 45.0
    while True:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            cluster_text = resp.read().decode()
        if "ray_flotilla_generation_tokens_total" in cluster_text and "ray_flotilla_memory_used_bytes" in cluster_text:
            break
        assert time.monotonic() < deadline, "flotilla metrics never reached Ray's endpoint"
        time.sleep(0.5)  # Ray exports on its own timer (no event to wait on); bounded by the deadline
    server.assert_pages_free()


def _tier(lookups: int, hits: int, errors: int, held: int) -> tuple[tuple[str, float], ...]:
    return (("lookups", lookups), ("hits", hits), ("bytes_read", hits * 100), ("bytes_written", 50),
            ("load_seconds", 0.25), ("errors", errors), ("blocks", 1), ("bytes", held))  # fmt: skip


def test_kv_tier_counters_reach_the_exposition_per_tier() -> None:
    rm = ReplicaMetrics("tiny", "r1", export_to_ray=False)
    engine_only = ("engine", (("load_timeouts", 3), ("dropped_saves", 0), ("tier_hit_tokens", 64)))
    rm.update(stats(kv_tiers=(("host", _tier(4, 2, 0, 700)), ("cluster", _tier(10, 6, 1, 900)), engine_only)))
    rm.update(stats(kv_tiers=(("host", _tier(6, 3, 0, 650)), ("cluster", _tier(12, 6, 2, 900)), engine_only)))
    s = samples(rm.render())
    assert s[("flotilla:kv_tier_hits_total", (("tier", "host"),))] == 3
    assert s[("flotilla:kv_tier_lookups_total", (("tier", "cluster"),))] == 12
    assert s[("flotilla:kv_tier_errors_total", (("tier", "cluster"),))] == 2
    assert s[("flotilla:kv_tier_bytes_read_total", (("tier", "cluster"),))] == 600
    assert s[("flotilla:kv_tier_bytes", (("tier", "host"),))] == 650  # a gauge: what is held now
    assert not any(labels == (("tier", "engine"),) for _, labels in s)  # the engine's counts are not a tier



def test_moe_expert_counters_sum_layers_and_the_imbalance_gauge_waits_for_a_full_window() -> None:
    rm = ReplicaMetrics("moe", "r1", export_to_ray=False)
    assert not any(name.startswith("flotilla:moe_") for name, _ in samples(rm.render()))  # nothing until known

    def update(*layers: tuple[int, ...]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        rm.update(stats(moe_expert_tokens=layers))
        return samples(rm.render())

    def per_expert(s: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> list[float]:
        return [s[("flotilla:moe_expert_tokens_total", (("expert", str(e)),))] for e in range(4)]

    s = update((2, 2, 2, 2), (1, 1, 2, 4))
    assert per_expert(s) == [3, 3, 4, 6]  # summed over the layers
    assert ("flotilla:moe_expert_load_imbalance", ()) not in s  # too few tokens for the ratio to mean much
    # A full window (4 experts x MOE_WINDOW_MEAN_TOKENS per layer) since the start: layer 1's expert 3
    # has twice its layer's mean, layer 0 is even.
    q = m.MOE_WINDOW_MEAN_TOKENS
    even, hot = (2 + q,) * 4, (1 + q // 2, 1 + q // 2, 2 + q, 4 + 2 * q)
    s = update(even, hot)
    assert s[("flotilla:moe_expert_load_imbalance", ())] == 2.0
    assert per_expert(s) == [3 + 3 * q // 2, 3 + 3 * q // 2, 4 + 2 * q, 6 + 3 * q]
    # The next window starts there: a short one leaves the gauge alone, a full even one brings it to 1.
    assert update((3 + q, *even[1:]), (*hot[:2], hot[2] + 1, hot[3]))[("flotilla:moe_expert_load_imbalance", ())] == 2.0
    s = update(tuple(n + q for n in even), tuple(n + q for n in hot))
    assert s[("flotilla:moe_expert_load_imbalance", ())] == 1.0
    # A restarted engine counts from zero: the counters add its counts, its window starts at zero.
    before = per_expert(s)
    s = update((q, q, q, 4 * q), (q, q, q, q))
    assert per_expert(s) == [n + 2 * q for n in before[:3]] + [before[3] + 5 * q]
    assert s[("flotilla:moe_expert_load_imbalance", ())] == pytest.approx(16 / 7)  # layer 0: 4q of 7q over 4 experts
