"""SLO-aware autoscaling: properties of ``decide``, clocked scenarios, the Serve 2.60 hook."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ray.serve import autoscaling_policy
from ray.serve import config as serve_config
from ray.serve._private import autoscaling_state

from actors.api import EngineStats
from cluster.autoscaling import (
    STATE_KEY,
    AutoscalingConfig,
    PolicyState,
    SLOAutoscalingPolicy,
    decide,
    pressure,
)
from cluster.autoscaling_metrics import (
    METRIC_NUM_WAITING,
    METRIC_TTFT_P95_MS,
    ReplicaLoad,
    autoscaling_stats,
    loads_from_metrics,
)
from scheduling.errors import InvalidParameterError

IDLE = ReplicaLoad()


@st.composite
def configs(draw: st.DrawFn) -> AutoscalingConfig:
    lo = draw(st.integers(0, 8))
    return AutoscalingConfig(
        min_replicas=lo,
        max_replicas=draw(st.integers(max(lo, 1), 24)),
        target_queue_per_replica=draw(st.floats(0.5, 16)),
        slo_ttft_ms=draw(st.floats(50, 5000)),
        slo_tpot_ms=draw(st.floats(5, 500)),
        upscale_delay_s=draw(st.sampled_from([0.0, 10.0, 30.0])),
        downscale_delay_s=draw(st.sampled_from([0.0, 60.0, 300.0])),
        headroom=draw(st.floats(0.1, 0.95)),
        max_step_up=draw(st.integers(1, 8)),
    )


loads_st = st.lists(
    st.builds(
        ReplicaLoad,
        num_waiting=st.sampled_from([0.0, 0.0, 1.0, 3.0, 50.0]),
        num_running=st.floats(0, 64),
        kv_usage=st.floats(0, 1),
        ttft_p95_ms=st.floats(0, 10_000),
        tpot_p95_ms=st.floats(0, 1_000),
    ),
    max_size=12,
)
stamps = st.one_of(st.none(), st.floats(0, 1000))
states_st = st.builds(PolicyState, up_since=stamps, down_since=stamps)


@settings(max_examples=200, deadline=None)
@given(configs(), st.integers(0, 40), loads_st, st.floats(0, 2000), states_st)
def test_decision_always_within_bounds(
    config: AutoscalingConfig, n: int, loads: list[ReplicaLoad], now: float, state: PolicyState
) -> None:
    desired, _, reason = decide(config, n, loads, now, state)
    assert config.min_replicas <= desired <= config.max_replicas, reason


@settings(max_examples=200, deadline=None)
@given(configs(), st.data(), loads_st, st.floats(0, 2000), states_st)
def test_never_scales_down_under_breach_or_queue(
    config: AutoscalingConfig, data: st.DataObject, loads: list[ReplicaLoad], now: float,
    state: PolicyState,
) -> None:
    n = data.draw(st.integers(config.min_replicas, config.max_replicas))
    desired, _, reason = decide(config, n, loads, now, state)
    busy = any(
        load.num_waiting > 0
        or load.ttft_p95_ms > config.slo_ttft_ms
        or load.tpot_p95_ms > config.slo_tpot_ms
        for load in loads
    )
    if busy:
        assert desired >= n, reason
    if pressure(config, loads) <= 1.0:
        assert desired <= n, reason  # no scale-up without pressure


@settings(max_examples=200, deadline=None)
@given(configs(), st.data(), loads_st, st.floats(0, 2000))
def test_scale_up_is_proportional_once_delay_elapsed(
    config: AutoscalingConfig, data: st.DataObject, loads: list[ReplicaLoad], now: float
) -> None:
    n = data.draw(st.integers(max(config.min_replicas, 1), config.max_replicas))
    p = pressure(config, loads)
    state = PolicyState(up_since=now - config.upscale_delay_s)
    desired, new_state, reason = decide(config, n, loads, now, state)
    if p > 1.0:
        stepped = max(n + 1, math.ceil(n * p - 1e-9))
        expected = min(config.max_replicas, n + config.max_step_up, stepped)
        assert desired == max(n, expected), reason
        if n < config.max_replicas:
            assert desired > n
            assert new_state.up_since == now and new_state.last_change_at == now


def test_proportional_examples() -> None:
    config = AutoscalingConfig(max_replicas=20, upscale_delay_s=0, max_step_up=10)
    queued = [ReplicaLoad(num_waiting=6)] * 2  # 1.5x target
    assert decide(config, 2, queued, 0.0, PolicyState()).desired_replicas == 3
    slow = [IDLE, ReplicaLoad(ttft_p95_ms=config.slo_ttft_ms * 2.5)]
    assert decide(config, 2, slow, 0.0, PolicyState()).desired_replicas == 5
    capped = AutoscalingConfig(max_replicas=20, upscale_delay_s=0, max_step_up=2)
    hot = [ReplicaLoad(num_waiting=100)] * 4
    assert decide(capped, 4, hot, 0.0, PolicyState()).desired_replicas == 6


class Sim:
    """Drives ``decide`` on a simulated clock, as Serve's control loop would."""

    def __init__(self, config: AutoscalingConfig, replicas: int) -> None:
        self.config, self.replicas, self.state = config, replicas, PolicyState()
        self.history: list[tuple[float, int]] = []

    def tick(self, now: float, load: ReplicaLoad) -> int:
        desired, self.state, _ = decide(
            self.config, self.replicas, [load] * self.replicas, now, self.state
        )
        if desired != self.replicas:
            self.history.append((now, desired))
        self.replicas = desired
        return desired


CFG = AutoscalingConfig(min_replicas=1, max_replicas=10, target_queue_per_replica=4,
                        upscale_delay_s=30, downscale_delay_s=120, max_step_up=4)


def test_burst_scales_up_after_the_delay() -> None:
    sim = Sim(CFG, 2)
    burst = ReplicaLoad(num_waiting=12, ttft_p95_ms=500)  # 3x the queue target
    for t in range(0, 30, 5):
        assert sim.tick(float(t), burst) == 2, f"scaled before the delay at t={t}"
    assert sim.tick(30.0, burst) == 6
    assert sim.history == [(30.0, 6)]
    # Pressure persists: the next step needs another full delay; 6 * 3 is capped at +4.
    assert sim.tick(45.0, burst) == 6
    assert sim.tick(60.0, burst) == 10


def test_oscillation_around_the_threshold_does_not_flap() -> None:
    sim = Sim(CFG, 3)
    over = ReplicaLoad(num_waiting=5)  # pressure 1.25
    band = ReplicaLoad(num_waiting=3)  # pressure 0.75: neither up nor down
    idle = ReplicaLoad(ttft_p95_ms=100)
    for t in range(0, 3600, 10):
        sim.tick(float(t), over if (t // 20) % 2 == 0 else band)
    for t in range(3600, 7200, 10):
        sim.tick(float(t), idle if (t // 60) % 2 == 0 else band)
    assert sim.history == []


def test_sustained_idleness_scales_down_one_step_per_delay() -> None:
    sim = Sim(CFG, 5)
    idle = ReplicaLoad(num_running=1, ttft_p95_ms=200, tpot_p95_ms=20, kv_usage=0.2)
    for t in range(0, 1000, 10):
        sim.tick(float(t), idle)
    assert sim.history == [(120.0, 4), (240.0, 3), (360.0, 2), (480.0, 1)]


def test_downscale_waits_for_headroom_and_empty_queues() -> None:
    tight = ReplicaLoad(ttft_p95_ms=CFG.slo_ttft_ms * 0.9)  # within SLO, not within headroom
    full_kv = ReplicaLoad(kv_usage=0.95)
    for load in (tight, full_kv, ReplicaLoad(num_waiting=1)):
        sim = Sim(CFG, 4)
        for t in range(0, 1000, 10):
            sim.tick(float(t), load)
        assert sim.history == [], load


def test_breaking_condition_resets_timer() -> None:
    over, band = ReplicaLoad(num_waiting=8), ReplicaLoad(num_waiting=2)
    sim = Sim(CFG, 2)
    sim.tick(0.0, over)
    sim.tick(25.0, band)
    assert sim.state.up_since is None
    sim.tick(30.0, over)
    assert sim.tick(55.0, over) == 2
    assert sim.tick(60.0, over) == 4


def test_no_loads_holds_and_bounds_apply_at_once() -> None:
    state = PolicyState(up_since=0.0, down_since=0.0)
    desired, new_state, _ = decide(CFG, 3, [], 500.0, state)
    assert (desired, new_state.up_since, new_state.down_since) == (3, None, None)
    assert decide(CFG, 0, [], 0.0, PolicyState()).desired_replicas == 1
    assert decide(CFG, 14, [ReplicaLoad(num_waiting=99)], 0.0, PolicyState())[0] == 10


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"min_replicas": -1}, "min_replicas"), ({"max_step_up": 0}, "max_step_up"),
        ({"min_replicas": 3, "max_replicas": 2}, "max_replicas"),
        ({"max_replicas": 0, "min_replicas": 0}, "max_replicas"),
        ({"target_queue_per_replica": 0}, "target_queue_per_replica"),
        ({"slo_ttft_ms": float("nan")}, "slo_ttft_ms"), ({"slo_tpot_ms": -1}, "slo_tpot_ms"),
        ({"upscale_delay_s": -1}, "upscale_delay_s"), ({"headroom": 1.0}, "headroom"),
        ({"downscale_delay_s": float("inf")}, "downscale_delay_s"),
    ],
)
def test_config_validation_names_the_parameter(kwargs: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidParameterError) as info:
        AutoscalingConfig(**kwargs)
    assert info.value.param == param


def test_state_round_trips_through_a_dict() -> None:
    state = PolicyState(up_since=1.5, down_since=None, last_desired=3, last_change_at=0.5)
    assert PolicyState.from_dict(state.to_dict()) == state
    assert PolicyState.from_dict(None) == PolicyState()


def test_replica_metrics_from_engine_stats() -> None:
    stats = EngineStats(
        num_waiting=3, num_running=5, num_unfinished_requests=8, num_kv_pages_total=100,
        num_kv_pages_free=40, num_kv_pages_used=60, num_kv_pages_evictable=20,
        num_kv_pages_locked=5, prefix_cache_hit_rate=0.5, num_preemptions=0, num_steps=9,
        ttft_ms_p50=10.0, ttft_ms_p95=999.0, tpot_ms_p50=1.0, tpot_ms_p95=999.0,
    )
    metrics = autoscaling_stats(stats, ttft_ms_p95=30.0, tpot_ms_p95=2.0)  # the replica's recent window
    assert all(isinstance(v, float) for v in metrics.values())  # Serve requires int|float
    per_replica = {key: {"r1": value} for key, value in metrics.items()}
    assert loads_from_metrics(per_replica) == [
        ReplicaLoad(num_waiting=3, num_running=5, kv_usage=0.4, ttft_p95_ms=30, tpot_p95_ms=2)
    ]
    assert loads_from_metrics(None) == []


def ctx(current: int, target: int, metrics: dict[str, dict[str, float]], now: float,
        policy_state: dict[str, Any], lo: int = 1, hi: int = 10) -> SimpleNamespace:
    """The AutoscalingContext attributes the adapter reads."""
    return SimpleNamespace(
        current_num_replicas=current, target_num_replicas=target, aggregated_metrics=metrics,
        capacity_adjusted_min_replicas=lo, capacity_adjusted_max_replicas=hi,
        policy_state=policy_state, current_time=now,
    )


def test_adapter_keeps_state_between_ticks_and_holds_during_transitions() -> None:
    policy = SLOAutoscalingPolicy(upscale_delay_s=10, target_queue_per_replica=2)
    hot = {METRIC_NUM_WAITING: {"a": 6.0, "b": 6.0}, METRIC_TTFT_P95_MS: {"a": 1.0}}
    n, state = policy(ctx(2, 2, hot, 0.0, {"serve_internal": 7}))  # type: ignore[arg-type]
    assert n == 2 and state["serve_internal"] == 7 and state[STATE_KEY]["up_since"] == 0.0
    n, state = policy(ctx(2, 2, hot, 10.0, state))  # type: ignore[arg-type]
    assert n == 6 and policy.last_reason.startswith("scale up")
    n, state = policy(ctx(3, 6, hot, 15.0, state))  # type: ignore[arg-type]
    assert n == 6 and policy.last_reason == "hold: scaling up in progress"
    n, state = policy(ctx(3, 6, hot, 20.0, state))  # pressure 3 on 3 running: 9, capped at +4 = 7
    assert n == 7 and "while 3 start" in policy.last_reason
    n, state = policy(ctx(7, 4, hot, 21.0, state))  # type: ignore[arg-type]
    assert n == 4 and state[STATE_KEY]["up_since"] is None  # draining: hold, timers reset
    n, _ = policy(ctx(6, 6, hot, 30.0, state, hi=4))  # type: ignore[arg-type]
    assert n == 4  # capacity-adjusted bounds win


def test_adapter_rejects_bounds_in_policy_kwargs() -> None:
    with pytest.raises(InvalidParameterError, match="max_replicas: set it in autoscaling_config"):
        SLOAutoscalingPolicy(max_replicas=3)
    with pytest.raises(InvalidParameterError, match="headroom"):
        SLOAutoscalingPolicy(headroom=2.0)


def test_adapter_through_serve_2_60_policy_machinery() -> None:
    """Serve's own resolution and wrapper (no cluster): class + kwargs -> (int, dict)."""
    config = serve_config.AutoscalingConfig(
        min_replicas=1, max_replicas=8, upscale_delay_s=0, downscale_delay_s=0,
        policy=serve_config.AutoscalingPolicy(
            policy_function="cluster.autoscaling:SLOAutoscalingPolicy",
            policy_kwargs={"upscale_delay_s": 0, "target_queue_per_replica": 2},
        ),
    )
    policy = autoscaling_policy._apply_autoscaling_config(
        autoscaling_state._resolve_policy_callable(config.policy)
    )
    context = serve_config.AutoscalingContext(
        deployment_id=None, deployment_name="llm", app_name="app", current_num_replicas=2,
        target_num_replicas=2, running_replicas=[], total_num_requests=lambda: 12.0,
        total_queued_requests=lambda: 0.0,
        aggregated_metrics=lambda: {METRIC_NUM_WAITING: {"a": 4.0, "b": 4.0}},
        raw_metrics=None, capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=8,
        policy_state={}, last_scale_up_time=None, last_scale_down_time=None,
        current_time=100.0, config=config,
    )
    desired, state = policy(context)
    assert desired == 4
    assert state[STATE_KEY]["last_change_at"] == 100.0
