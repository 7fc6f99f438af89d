"""Autoscaling wiring without a cluster: Serve config from app args, builder, replica stats."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from ray.serve import config as serve_config

from actors.api import EngineStats, FinishReason, LatencyWindow, SequenceDelta, SequenceTiming
from apps.builder import (
    DEFAULT_GRACEFUL_SHUTDOWN_TIMEOUT_S,
    GRACEFUL_SHUTDOWN_WAIT_LOOP_S,
    deployment_options,
    split_args,
)
from apps.replica.stats import ReplicaStats
from cluster.autoscaling import (
    POLICY_PATH,
    AutoscalingConfig,
    PolicyState,
    decide,
    serve_autoscaling_config,
)
from cluster.autoscaling_metrics import METRIC_NUM_WAITING, METRIC_TTFT_P95_MS, ReplicaLoad
from cluster.request_router import ROUTER_CLASS
from scheduling.errors import InvalidParameterError


def test_flotilla_policy_config_zeroes_serves_own_delays() -> None:
    cfg = serve_autoscaling_config({"min_replicas": 1, "max_replicas": 4, "slo_ttft_ms": 800,
                                    "upscale_delay_s": 5, "look_back_period_s": 6})
    assert cfg["min_replicas"] == 1 and cfg["max_replicas"] == 4 and cfg["look_back_period_s"] == 6
    assert cfg["upscale_delay_s"] == 0 and cfg["downscale_delay_s"] == 0
    assert cfg["policy"] == {"policy_function": POLICY_PATH,
                             "policy_kwargs": {"slo_ttft_ms": 800, "upscale_delay_s": 5}}
    serve_config.AutoscalingConfig(**cfg)  # Serve accepts it as is


def test_default_policy_config_for_side_by_side_runs() -> None:
    cfg = serve_autoscaling_config({"policy": "default", "max_replicas": 4, "upscale_delay_s": 3,
                                    "downscale_delay_s": 15, "target_ongoing_requests": 3})
    assert "policy" not in cfg
    assert (cfg["upscale_delay_s"], cfg["downscale_delay_s"], cfg["target_ongoing_requests"]) == (3, 15, 3.0)


@pytest.mark.parametrize(
    ("options", "param"),
    [({"policy": "magic"}, "policy"), ({"max_replicas": 2, "slo_tpot": 5}, "slo_tpot"),
     ({"min_replicas": 3, "max_replicas": 2}, "max_replicas"), ({"slo_ttft_ms": -1}, "slo_ttft_ms"),
     ({"policy": "default", "slo_ttft_ms": 5}, "slo_ttft_ms")],
)
def test_bad_autoscaling_options_name_the_parameter(options: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidParameterError) as info:
        serve_autoscaling_config(options)
    assert info.value.param == param


def test_idle_fleet_with_nothing_running_drops_to_the_minimum() -> None:
    config = AutoscalingConfig(min_replicas=1, max_replicas=8, downscale_delay_s=10)
    idle = [ReplicaLoad()] * 5
    desired, state, _ = decide(config, 5, idle, 0.0, PolicyState())
    assert desired == 5
    desired, _, reason = decide(config, 5, idle, 10.0, state)
    assert desired == 1, reason
    busy = [ReplicaLoad(num_running=1)] + [ReplicaLoad()] * 4
    assert decide(config, 5, busy, 10.0, state).desired_replicas == 4  # still working: one step


def test_builder_options_translate_to_deployment_options() -> None:
    engine, options = split_args({"model": "tiny", "max_num_seqs": 2, "autoscaling": {"max_replicas": 3},
                                  "request_router": "prefix", "replica_options": {"num_cpus": 0.1},
                                  "graceful_shutdown_timeout_s": 30, "served_model_name": "t"})
    assert engine == {"model": "tiny", "max_num_seqs": 2}
    out = deployment_options(options)
    assert options == {"served_model_name": "t"}  # what is left goes to LLMServer
    assert out["graceful_shutdown_timeout_s"] == 30 and "num_replicas" not in out
    assert out["autoscaling_config"]["max_replicas"] == 3
    assert out["request_router_config"]["request_router_class"] == ROUTER_CLASS
    assert out["ray_actor_options"] == {"num_cpus": 0.1}
    plain = deployment_options({"num_replicas": 2})
    assert plain.pop("request_router_config")["request_router_class"] == ROUTER_CLASS  # the prefix router by default
    assert plain == {"num_replicas": 2, "graceful_shutdown_timeout_s": DEFAULT_GRACEFUL_SHUTDOWN_TIMEOUT_S,
                     "graceful_shutdown_wait_loop_s": GRACEFUL_SHUTDOWN_WAIT_LOOP_S}
    assert "request_router_config" not in deployment_options({"request_router": "default"})
    with pytest.raises(InvalidParameterError, match="autoscale"):
        split_args({"autoscale": {}})
    with pytest.raises(InvalidParameterError) as info:
        deployment_options({"graceful_shutdown_timeout_s": 0})
    assert info.value.param == "graceful_shutdown_timeout_s"


def _finished(ttft_s: float, tpot_s: float, n: int = 11, reason: str = "length") -> SequenceDelta:
    timing = SequenceTiming(arrival_time=0.0, first_token_time=ttft_s,
                            last_token_time=ttft_s + tpot_s * (n - 1), num_output_tokens=n)
    return SequenceDelta(request_id="r", index=0, token_ids=[1], text="x", logprobs=None,
                         finish_reason=FinishReason(reason), timing=timing)


def test_recent_latency_forgets_old_samples() -> None:
    window = LatencyWindow(64, max_age_s=10)

    def p95(now: float) -> tuple[float, float]:
        return window.ms("ttft", 95, now), window.ms("tpot", 95, now)

    window.observe([_finished(5.0, 0.5)], now=0.0)  # a slow burst
    window.observe([_finished(0.1, 0.01, reason="abort")], now=0.0)  # aborted: not counted
    assert p95(5.0) == pytest.approx((5000.0, 500.0))
    window.observe([_finished(0.1, 0.01)], now=9.0)
    assert p95(10.5) == pytest.approx((100.0, 10.0))  # the burst aged out
    assert p95(30.0) == (0.0, 0.0)


STATS = EngineStats(num_waiting=3, num_running=2, num_unfinished_requests=5, num_kv_pages_total=10,
                    num_kv_pages_free=5, num_kv_pages_used=5, num_kv_pages_evictable=0,
                    num_kv_pages_locked=0, prefix_cache_hit_rate=0.5, num_preemptions=0, num_steps=1,
                    ttft_ms_p50=1.0, ttft_ms_p95=99999.0, tpot_ms_p50=1.0, tpot_ms_p95=99999.0)


class FakeReplica(ReplicaStats):
    def __init__(self) -> None:
        seen: list[int] = []
        self.seen = seen

        async def stats() -> EngineStats:
            return STATS

        self._scheduler = SimpleNamespace(stats=stats)
        self.model_name = "tiny"
        # As LLMServer.__init__ does: the fan-out's observer feeds the window, then the metrics.
        self._fanout = SimpleNamespace(num_open=4,
                                       _observer=self.latency_observer(lambda deltas: seen.append(len(deltas))))


def test_replica_reports_recent_latency_and_routing_load() -> None:
    replica = FakeReplica()
    auto = asyncio.run(replica.record_autoscaling_stats())
    assert auto[METRIC_NUM_WAITING] == 3.0
    assert auto[METRIC_TTFT_P95_MS] == 0.0  # not the engine's stale 99999: nothing finished recently
    replica._fanout._observer([_finished(0.2, 0.01)])  # metrics, then the window
    assert replica.seen == [1]
    assert asyncio.run(replica.record_autoscaling_stats())[METRIC_TTFT_P95_MS] == pytest.approx(200.0)
    routing = asyncio.run(replica.record_routing_stats())
    assert routing["num_open"] == 4 and routing["num_waiting"] == 3
    assert routing["loras"] == list(STATS.lora_adapters) and routing["served_model"] == "tiny"


def test_pending_scale_up_is_cancelled_once_the_load_is_gone() -> None:
    from cluster.autoscaling import STATE_KEY, SLOAutoscalingPolicy
    from cluster.autoscaling_metrics import METRIC_NUM_RUNNING

    policy = SLOAutoscalingPolicy(upscale_delay_s=0, downscale_delay_s=10)
    idle = {METRIC_NUM_WAITING: {"a": 0.0}, METRIC_NUM_RUNNING: {"a": 0.0}}

    def tick(current: int, target: int, now: float, state: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        ctx = SimpleNamespace(current_num_replicas=current, target_num_replicas=target,
                              aggregated_metrics=idle, capacity_adjusted_min_replicas=1,
                              capacity_adjusted_max_replicas=8, policy_state=state, current_time=now)
        return policy(ctx)  # type: ignore[arg-type]

    n, state = tick(1, 4, 0.0, {})  # three replicas still starting; the one running is idle
    assert n == 4 and state[STATE_KEY]["down_since"] == 0.0
    n, state = tick(1, 4, 9.0, state)
    assert n == 4
    n, state = tick(1, 4, 10.0, state)
    assert n == 1 and policy.last_reason.startswith("scale down 4 -> 1 before starting")
