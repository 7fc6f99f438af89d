"""Per-pool autoscaling (prefill/decode disaggregation): each pool's signals, through the same ``decide``."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ray.serve import config as serve_config

from actors.api import EngineStats
from cluster.autoscaling import (
    POLICY_PATH,
    AutoscalingConfig,
    PolicyState,
    SLOAutoscalingPolicy,
    decide,
    is_idle,
    pressure,
    serve_autoscaling_config,
)
from cluster.autoscaling_metrics import (
    METRIC_NUM_RUNNING,
    METRIC_NUM_WAITING,
    METRIC_NUM_WAITING_PROMPT_TOKENS,
    METRIC_TTFT_P95_MS,
    ReplicaLoad,
    autoscaling_stats,
    loads_from_metrics,
)
from scheduling.errors import InvalidParameterError

TIMING: dict[str, Any] = {"min_replicas": 1, "max_replicas": 10, "upscale_delay_s": 30, "downscale_delay_s": 120,
          "max_step_up": 4}
PREFILL = AutoscalingConfig(pool="prefill", **TIMING)  # 4096 prompt tokens, TTFT 2000 ms
DECODE = AutoscalingConfig(pool="decode", **TIMING)  # 32 running, TPOT 100 ms
MIXED = AutoscalingConfig(**TIMING)  # pool=None: today's single kind of replica

# A long-prompt backlog as a prefill replica sees it: three prefill replicas' worth of
# queued prompt tokens in a handful of requests, and TTFT over its SLO.
BACKLOG = ReplicaLoad(num_waiting=3, num_running=1, num_waiting_prompt_tokens=3 * 4096,
                      ttft_p95_ms=2500)


class Sim:
    """Drives ``decide`` for one pool on a simulated clock, every replica reporting ``load``."""

    def __init__(self, config: AutoscalingConfig, replicas: int) -> None:
        self.config, self.replicas, self.state = config, replicas, PolicyState()
        self.history: list[tuple[float, int]] = []

    def run(self, start: int, stop: int, load: ReplicaLoad) -> int:
        for t in range(start, stop, 5):
            desired, self.state, _ = decide(self.config, self.replicas, [load] * self.replicas,
                                            float(t), self.state)
            if desired != self.replicas:
                self.history.append((float(t), desired))
            self.replicas = desired
        return self.replicas


def test_prefill_pool_scales_up_under_a_long_prompt_backlog() -> None:
    assert pressure(PREFILL, [BACKLOG]) == pytest.approx(3.0)
    sim = Sim(PREFILL, 2)
    assert sim.run(0, 30, BACKLOG) == 2  # not before the delay
    assert sim.run(30, 35, BACKLOG) == 6  # proportional: ceil(2 * 3), within +4
    assert sim.history == [(30.0, 6)]
    # Queued prompt tokens alone, TTFT still fine (it lags: it counts finished requests).
    tokens_only = replace(BACKLOG, ttft_p95_ms=100)
    assert decide(replace(PREFILL, upscale_delay_s=0), 2, [tokens_only] * 2, 0.0,
                  PolicyState()).desired_replicas == 6
    # TTFT alone.
    slow = ReplicaLoad(ttft_p95_ms=PREFILL.slo_ttft_ms * 1.5)
    assert decide(replace(PREFILL, upscale_delay_s=0), 2, [slow, ReplicaLoad()], 0.0,
                  PolicyState()).desired_replicas == 3


def test_decode_pool_does_not_react_to_queued_prompt_tokens() -> None:
    # 20 running each: in the dead band (pressure 0.625, and 40 would not fit one replica).
    prompts = ReplicaLoad(num_running=20, num_waiting_prompt_tokens=50_000, ttft_p95_ms=9000,
                          tpot_p95_ms=20)
    assert pressure(DECODE, [prompts]) == pytest.approx(20 / 32)
    sim = Sim(DECODE, 2)
    assert sim.run(0, 600, prompts) == 2
    assert sim.history == []


def test_prefill_pool_does_not_react_to_running_sequences_or_tpot() -> None:
    # TTFT at 0.75 of its SLO: the dead band, whatever runs and however slowly it decodes.
    decoding = ReplicaLoad(num_running=200, tpot_p95_ms=900, kv_usage=0.95, ttft_p95_ms=1500)
    assert pressure(PREFILL, [decoding]) == pytest.approx(0.75)
    sim = Sim(PREFILL, 3)
    assert sim.run(0, 600, decoding) == 3
    assert sim.history == []


@pytest.mark.parametrize(
    ("load", "expected"),
    [
        (ReplicaLoad(num_running=64, tpot_p95_ms=40), 4),  # 2x the running target
        (ReplicaLoad(num_running=8, tpot_p95_ms=250), 5),  # TPOT 2.5x its SLO
        # Batch capped below the target (max_num_seqs 8): arrivals queue for a slot.
        (ReplicaLoad(num_running=8, num_waiting=12, tpot_p95_ms=40), 6),
    ],
)
def test_decode_pool_scales_on_running_sequences_tpot_and_waiting(load: ReplicaLoad,
                                                                  expected: int) -> None:
    sim = Sim(DECODE, 2)
    assert sim.run(0, 30, load) == 2
    assert sim.run(30, 35, load) == expected


@pytest.mark.parametrize("config", [PREFILL, DECODE], ids=["prefill", "decode"])
def test_both_pools_scale_down_when_idle_after_the_delay(config: AutoscalingConfig) -> None:
    working = ReplicaLoad(num_running=1, ttft_p95_ms=300, tpot_p95_ms=20, kv_usage=0.1)
    sim = Sim(config, 5)
    assert sim.run(0, 600, working) == 1
    assert sim.history == [(120.0, 4), (240.0, 3), (360.0, 2), (480.0, 1)]  # one step per delay
    sim = Sim(config, 5)
    assert sim.run(0, 120, ReplicaLoad()) == 5  # nothing runs: straight to the minimum...
    assert sim.run(120, 125, ReplicaLoad()) == 1  # ...once the delay has passed
    assert sim.history == [(120.0, 1)]


def test_prefill_pool_keeps_replicas_while_prompt_tokens_are_queued() -> None:
    queued = ReplicaLoad(num_waiting=1, num_waiting_prompt_tokens=100, ttft_p95_ms=100)
    assert not is_idle(PREFILL, [ReplicaLoad(), queued])
    tight = ReplicaLoad(ttft_p95_ms=PREFILL.slo_ttft_ms * 0.9)  # within SLO, not within headroom
    for load in (queued, tight):
        assert Sim(PREFILL, 4).run(0, 1000, load) == 4


def test_decode_pool_scale_down_never_overloads_the_fleet_it_leaves() -> None:
    # 2 x 20 running: each within headroom of 32, but 40 on one replica would be pressure 1.25.
    assert Sim(DECODE, 2).run(0, 2000, ReplicaLoad(num_running=20, tpot_p95_ms=20)) == 2
    # 64 sequences over 4 replicas: one fewer carries 21.3 each (<= 0.7 * 32), two fewer 32 (not).
    n, state = 4, PolicyState()
    for t in range(0, 2000, 5):
        spread = [ReplicaLoad(num_running=64 / n, tpot_p95_ms=20)] * n
        n, state, _ = decide(DECODE, n, spread, float(t), state)
    assert n == 3
    for blocked in (ReplicaLoad(num_waiting=1), ReplicaLoad(kv_usage=0.9),
                    ReplicaLoad(tpot_p95_ms=DECODE.slo_tpot_ms * 0.9)):
        assert not is_idle(DECODE, [blocked, ReplicaLoad(), ReplicaLoad()]), blocked


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(0, 100), min_size=2, max_size=12), st.floats(0.1, 0.95), st.floats(1, 256))
def test_decode_idle_means_one_fewer_stays_under_target(running: list[float], headroom: float,
                                                        target: float) -> None:
    config = AutoscalingConfig(pool="decode", headroom=headroom, target_running_per_replica=target)
    loads = [ReplicaLoad(num_running=r) for r in running]
    if is_idle(config, loads):
        fewer = [ReplicaLoad(num_running=sum(running) / (len(running) - 1))] * (len(running) - 1)
        assert pressure(config, fewer) <= 1.0 + 1e-9


loads_st = st.lists(
    st.builds(ReplicaLoad, num_waiting=st.sampled_from([0.0, 2.0, 50.0]), num_running=st.floats(0, 64),
              kv_usage=st.floats(0, 1), ttft_p95_ms=st.floats(0, 10_000), tpot_p95_ms=st.floats(0, 1_000),
              num_waiting_prompt_tokens=st.floats(0, 100_000)),
    max_size=8,
)


@settings(max_examples=200, deadline=None)
@given(loads_st)
def test_default_pool_is_unchanged_and_ignores_prompt_tokens(loads: list[ReplicaLoad]) -> None:
    if loads:
        expected = max(sum(x.num_waiting for x in loads) / len(loads) / MIXED.target_queue_per_replica,
                       max(x.ttft_p95_ms for x in loads) / MIXED.slo_ttft_ms,
                       max(x.tpot_p95_ms for x in loads) / MIXED.slo_tpot_ms)
        assert pressure(MIXED, loads) == pytest.approx(expected)
    no_tokens = [replace(x, num_waiting_prompt_tokens=0.0) for x in loads]
    assert pressure(MIXED, loads) == pressure(MIXED, no_tokens)
    assert is_idle(MIXED, loads) == is_idle(MIXED, no_tokens)
    for n in (1, 4):
        assert decide(MIXED, n, loads, 100.0, PolicyState()) == decide(MIXED, n, no_tokens, 100.0,
                                                                         PolicyState())


def test_replicas_report_queued_prompt_tokens() -> None:
    stats = EngineStats(
        num_waiting=2, num_running=1, num_unfinished_requests=3, num_kv_pages_total=10,
        num_kv_pages_free=10, num_kv_pages_used=0, num_kv_pages_evictable=0, num_kv_pages_locked=0,
        prefix_cache_hit_rate=0.0, num_preemptions=0, num_steps=1, ttft_ms_p50=1.0, ttft_ms_p95=1.0,
        tpot_ms_p50=1.0, tpot_ms_p95=1.0, num_waiting_prompt_tokens=9000,
    )
    metrics = autoscaling_stats(stats, ttft_ms_p95=5.0, tpot_ms_p95=0.0)
    assert metrics[METRIC_NUM_WAITING_PROMPT_TOKENS] == 9000.0
    load, = loads_from_metrics({key: {"r": value} for key, value in metrics.items()})
    assert load.num_waiting_prompt_tokens == 9000.0 and load.num_waiting == 2.0


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [({"pool": "mixed"}, "pool"), ({"target_prompt_tokens_per_replica": 0}, "target_prompt_tokens_per_replica"),
     ({"target_running_per_replica": float("inf")}, "target_running_per_replica"),
     ({"pool": "decode", "target_running_per_replica": float("nan")}, "target_running_per_replica")],
)
def test_pool_config_validation_names_the_parameter(kwargs: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidParameterError) as info:
        AutoscalingConfig(**kwargs)
    assert info.value.param == param


def test_serve_config_carries_each_pools_options() -> None:
    prefill = serve_autoscaling_config({"pool": "prefill", "min_replicas": 1, "max_replicas": 4,
                                        "target_prompt_tokens_per_replica": 8192, "slo_ttft_ms": 800})
    decode = serve_autoscaling_config({"pool": "decode", "max_replicas": 8, "target_running_per_replica": 64,
                                       "slo_tpot_ms": 50, "downscale_delay_s": 60})
    assert prefill["policy"] == {"policy_function": POLICY_PATH, "policy_kwargs": {
        "pool": "prefill", "target_prompt_tokens_per_replica": 8192, "slo_ttft_ms": 800}}
    assert decode["policy"]["policy_kwargs"] == {"pool": "decode", "target_running_per_replica": 64,
                                                 "slo_tpot_ms": 50, "downscale_delay_s": 60}
    assert (decode["max_replicas"], decode["upscale_delay_s"], decode["downscale_delay_s"]) == (8, 0.0, 0.0)
    default = serve_autoscaling_config({"policy": "default", "pool": "decode", "max_replicas": 2})
    assert "pool" not in default and default["max_replicas"] == 2
    for cfg in (prefill, decode, default):
        serve_config.AutoscalingConfig(**cfg)  # Serve accepts them as they are


@pytest.mark.parametrize(
    ("options", "param"),
    [({"pool": "decode", "slo_ttft_ms": 500}, "slo_ttft_ms"),
     ({"pool": "decode", "target_prompt_tokens_per_replica": 10}, "target_prompt_tokens_per_replica"),
     ({"pool": "prefill", "target_queue_per_replica": 2}, "target_queue_per_replica"),
     ({"pool": "prefill", "slo_tpot_ms": 50}, "slo_tpot_ms"),
     ({"target_running_per_replica": 8}, "target_running_per_replica"),  # pool None
     ({"pool": "both"}, "pool"), ({"policy": "default", "pool": "both"}, "pool"),
     ({"pool": "prefill", "target_prompt_tokens_per_replica": -1}, "target_prompt_tokens_per_replica")],
)
def test_a_target_the_pool_never_reads_is_rejected(options: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidParameterError) as info:
        serve_autoscaling_config(options)
    assert info.value.param == param


def test_policy_adapter_scales_the_prefill_pool_on_reported_prompt_tokens() -> None:
    policy = SLOAutoscalingPolicy(pool="prefill", upscale_delay_s=0, target_prompt_tokens_per_replica=1000)
    metrics = {METRIC_NUM_WAITING: {"a": 2.0, "b": 0.0}, METRIC_NUM_RUNNING: {"a": 1.0, "b": 1.0},
               METRIC_NUM_WAITING_PROMPT_TOKENS: {"a": 5000.0, "b": 1000.0},
               METRIC_TTFT_P95_MS: {"a": 100.0, "b": 100.0}}
    ctx = SimpleNamespace(current_num_replicas=2, target_num_replicas=2, aggregated_metrics=metrics,
                          capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=10,
                          policy_state={}, current_time=0.0)
    n, _ = policy(ctx)  # type: ignore[arg-type]
    assert n == 6 and policy.last_reason.startswith("scale up 2 -> 6")  # mean 3000 / 1000 = 3x
    with pytest.raises(InvalidParameterError) as info:
        SLOAutoscalingPolicy(pool="prefill", slo_tpot_ms=50)
    assert info.value.param == "slo_tpot_ms"
