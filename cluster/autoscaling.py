"""SLO-aware replica autoscaling: a pure decision core plus Ray Serve 2.60's policy hook.

``decide`` is a pure function of plain data and an explicit clock, so every rule
is testable without Ray. Rules, with ``n`` replicas and per-replica loads:

- pressure = max(mean waiting queue / target, worst TTFT P95 / SLO, worst TPOT
  P95 / SLO). Pressure above 1 is the *up* condition.
- *down* condition: every queue is empty and every replica's P95s (and KV use
  by running requests) sit within ``headroom`` of their limits.
- With prefill/decode disaggregation each pool is its own deployment with its
  own config; ``AutoscalingConfig.pool`` swaps the two signals above for the
  pool's own (prefill: queued prompt tokens and TTFT; decode: running
  sequences and TPOT; see ``cluster.autoscaling_pools``). Every rule below is
  the same for all pools.
- Between the two lies a dead band where nothing changes and both timers
  reset: that band, plus the timers, is the hysteresis that stops flapping.
- A condition must hold for ``upscale_delay_s`` / ``downscale_delay_s``
  before it acts; after acting its timer restarts, so sustained pressure (or
  idleness) moves one step per delay. Up steps are proportional,
  ``ceil(n * pressure)``, capped by ``max_step_up``; down steps remove one
  replica, or go straight to ``min_replicas`` when nothing runs anywhere.
- The result is always within ``[min_replicas, max_replicas]``.

Serve integration (checked against the installed ray 2.60.0 source,
``ray/serve/config.py``, ``ray/serve/autoscaling_policy.py``,
``ray/serve/_private/autoscaling_state.py`` and ``_private/replica.py``):
the deployment's ``autoscaling_config.policy`` is an ``AutoscalingPolicy`` whose
``policy_function`` is an import path; a class there is instantiated once with
``policy_kwargs`` and then called as ``policy(ctx: AutoscalingContext) ->
(num_replicas, policy_state_dict)`` every control-loop tick. Replicas feed it by
defining ``record_autoscaling_stats() -> dict[str, int | float]``; Serve
aggregates each key over ``look_back_period_s`` and hands it to the policy as
``ctx.aggregated_metrics[key][replica_id]``. Serve wraps every custom policy
with its own scaling factors and ``upscale_delay_s`` / ``downscale_delay_s``
timers, so set those two to 0 in the Serve config: the delays here are the
ones that should count.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, NamedTuple

# AutoscalingConfig, pressure and is_idle live beside the pools they read; callers import them here.
from cluster.autoscaling_metrics import ReplicaLoad, loads_from_metrics
from cluster.autoscaling_pools import AutoscalingConfig, check_pool_options, is_idle, pressure
from scheduling.errors import InvalidParameterError

if TYPE_CHECKING:
    from ray.serve.config import AutoscalingContext

logger = logging.getLogger("ray.serve")

# Where this policy keeps its own state inside Serve's ``policy_state`` dict
# (Serve adds its own delay-counter keys beside it).
STATE_KEY = "flotilla_policy_state"
# Float slack: 2 * 1.5 must not ceil to 4, nor 30 s of delay measure 29.999... s.
_EPS = 1e-9
_DELAY_EPS_S = 1e-6


@dataclass(frozen=True, slots=True)
class PolicyState:
    """The policy's memory between ticks.

    ``up_since`` / ``down_since``: when the up / down condition started holding
    (None while it does not); ``last_desired`` / ``last_change_at``: the most
    recent decision and when the replica count last changed.
    """

    up_since: float | None = None
    down_since: float | None = None
    last_desired: int | None = None
    last_change_at: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for Serve's ``policy_state``."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> PolicyState:
        """Inverse of ``to_dict``; unknown keys are ignored, missing ones default."""
        data = data or {}
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})


class Decision(NamedTuple):
    """``decide``'s result: unpacks as ``(desired_replicas, state, reason)``."""

    desired_replicas: int
    state: PolicyState
    reason: str


def decide(
    config: AutoscalingConfig,
    current_replicas: int,
    loads: list[ReplicaLoad],
    now: float,
    state: PolicyState,
) -> Decision:
    """The replica count to run now, the state to pass next tick, and why.

    ``loads`` holds one entry per replica that reported (it may be shorter than
    ``current_replicas`` while replicas start). No loads means no evidence: hold.
    """
    n = current_replicas
    lo, hi = config.min_replicas, config.max_replicas
    if n < lo or n > hi:
        # Bounds (e.g. a config change) apply at once; timers restart from here.
        target = min(max(n, lo), hi)
        return Decision(target, PolicyState(None, None, target, now), f"bring {n} within [{lo}, {hi}]")
    p = pressure(config, loads)
    if p > 1.0:
        up_since = state.up_since if state.up_since is not None else now
        waiting = PolicyState(up_since, None, n, state.last_change_at)
        if now - up_since + _DELAY_EPS_S < config.upscale_delay_s:
            return Decision(n, waiting, f"pressure {p:.2f} > 1 for {now - up_since:.1f}s, waiting")
        target = min(hi, n + config.max_step_up, max(n + 1, math.ceil(n * p - _EPS)))
        if target <= n:
            return Decision(n, waiting, f"pressure {p:.2f} > 1 but at max_replicas {hi}")
        # Restart the timer: further pressure needs another full delay to act.
        new_state = PolicyState(now, None, target, now)
        return Decision(target, new_state, f"scale up {n} -> {target}: pressure {p:.2f}")
    if is_idle(config, loads):
        down_since = state.down_since if state.down_since is not None else now
        waiting = PolicyState(None, down_since, n, state.last_change_at)
        if now - down_since + _DELAY_EPS_S < config.downscale_delay_s:
            return Decision(n, waiting, f"idle for {now - down_since:.1f}s, waiting")
        if n <= lo:
            return Decision(n, waiting, f"idle but at min_replicas {lo}")
        # Nothing running anywhere: no replica above the minimum is doing any work.
        target = lo if all(load.num_running <= 0 for load in loads) else n - 1
        new_state = PolicyState(None, now, target, now)
        return Decision(target, new_state, f"scale down {n} -> {target}: idle with headroom")
    # Dead band (or no evidence): hold and forget both timers.
    why = "no replica reported load" if not loads else f"pressure {p:.2f} within band"
    return Decision(n, PolicyState(None, None, n, state.last_change_at), f"hold: {why}")


class SLOAutoscalingPolicy:
    """Ray Serve 2.60 class-callable policy around ``decide``.

    Serve config::

        autoscaling_config:
          min_replicas: 1
          max_replicas: 8
          upscale_delay_s: 0      # the delays below replace Serve's own
          downscale_delay_s: 0
          policy:
            policy_function: cluster.autoscaling:SLOAutoscalingPolicy
            policy_kwargs: {slo_ttft_ms: 1500, upscale_delay_s: 20}

    ``policy_kwargs`` are ``AutoscalingConfig`` fields except the bounds, which
    come from each tick's capacity-adjusted ``min_replicas`` / ``max_replicas``;
    a disaggregated app's pools add ``pool: prefill`` or ``pool: decode``.
    """

    def __init__(self, **policy_kwargs: Any) -> None:
        for bound in ("min_replicas", "max_replicas"):
            if bound in policy_kwargs:
                raise InvalidParameterError(bound, "set it in autoscaling_config, not policy_kwargs")
        # Validate now, at deploy time, rather than on the first tick.
        self._kwargs = dict(policy_kwargs)
        check_pool_options(self._kwargs)
        AutoscalingConfig(min_replicas=0, max_replicas=1, **self._kwargs)
        pool = self._kwargs.get("pool")
        self._log_prefix = f"flotilla autoscaling ({pool})" if pool else "flotilla autoscaling"
        self.last_reason = ""

    def __call__(self, ctx: AutoscalingContext) -> tuple[int, dict[str, Any]]:
        """One control-loop tick: ``(desired replicas, policy_state)`` for Serve."""
        policy_state = dict(ctx.policy_state)
        state = PolicyState.from_dict(policy_state.get(STATE_KEY))
        now = ctx.current_time if ctx.current_time is not None else 0.0
        hi = max(1, ctx.capacity_adjusted_max_replicas)
        lo = min(ctx.capacity_adjusted_min_replicas, hi)
        config = AutoscalingConfig(min_replicas=lo, max_replicas=hi, **self._kwargs)
        current, target = ctx.current_num_replicas, ctx.target_num_replicas
        loads = loads_from_metrics(ctx.aggregated_metrics)
        if current == target:
            decision = decide(config, current, loads, now, state)
        elif target > current:
            # Replicas are starting (that takes a while). Pressure measured on the
            # running ones may already ask for more than the target: raise it
            # now, by the same rule, rather than after they all run.
            # And if the load is gone (idle for the downscale delay) before they
            # run, stop waiting for them: back to what the running ones need.
            further = decide(config, current, loads, now, state)
            down_since = further.state.down_since
            if further.desired_replicas > target:
                decision = further._replace(reason=f"{further.reason} (while {target - current} start)")
            elif down_since is not None and now - down_since + _DELAY_EPS_S >= config.downscale_delay_s:
                cancel = min(target, max(lo, further.desired_replicas))
                decision = Decision(cancel, PolicyState(None, now, cancel, now),
                                    f"scale down {target} -> {cancel} before starting: idle with headroom")
            else:
                held = PolicyState(further.state.up_since, down_since, target, state.last_change_at)
                decision = Decision(target, held, "hold: scaling up in progress")
        else:
            # Replicas are draining: judge the smaller fleet once it is alone,
            # a full delay from then on.
            held = PolicyState(None, None, target, state.last_change_at)
            decision = Decision(target, held, "hold: scaling down in progress")
        if decision.desired_replicas != ctx.target_num_replicas:  # a new decision, not a tick
            logger.info("%s: %s", self._log_prefix, decision.reason)
        self.last_reason = decision.reason
        policy_state[STATE_KEY] = decision.state.to_dict()
        return decision.desired_replicas, policy_state


POLICY_PATH = "cluster.autoscaling:SLOAutoscalingPolicy"
# Serve-side knobs: replicas push metrics every ``metrics_interval_s`` (Serve's
# default, 10 s, is too slow to meet a 30 s reaction target) and Serve averages
# them over ``look_back_period_s``.
_SERVE_DEFAULTS = {"metrics_interval_s": 1.0, "look_back_period_s": 4.0}
_SERVE_KEYS = ("min_replicas", "max_replicas", "initial_replicas", "metrics_interval_s",
               "look_back_period_s")


def serve_autoscaling_config(options: dict[str, Any]) -> dict[str, Any]:
    """A deployment's ``autoscaling_config`` from the app's ``autoscaling`` argument.

    ``policy: flotilla`` (default): this module's policy, with the other keys
    (``AutoscalingConfig`` fields: SLOs, ``target_queue_per_replica``, delays,
    ``headroom``, ``max_step_up``; for a disaggregated app's pools, ``pool`` and
    ``target_prompt_tokens_per_replica`` / ``target_running_per_replica``) as
    its ``policy_kwargs``, and Serve's own delays zeroed. A target the pool
    never reads is rejected, not ignored (``slo_ttft_ms`` on ``pool: decode``).
    ``policy: default``: Serve's request-based policy with
    ``target_ongoing_requests`` (default 2) and the same bounds and delays, for
    side-by-side runs; a ``pool`` given with it is checked, then unused (Serve's
    policy counts requests whatever the replica does). Invalid values raise
    ``InvalidParameterError`` here.
    """
    opts = dict(options)
    kind = opts.pop("policy", "flotilla")
    serve: dict[str, Any] = {**_SERVE_DEFAULTS, **{k: opts.pop(k) for k in _SERVE_KEYS if k in opts}}
    lo, hi = int(serve.get("min_replicas", 1)), int(serve.get("max_replicas", 1))
    serve["min_replicas"], serve["max_replicas"] = lo, hi
    if kind == "default":
        check_pool_options({"pool": opts.pop("pool", None)})
        own: dict[str, Any] = {k: opts.pop(k) for k in ("upscale_delay_s", "downscale_delay_s") if k in opts}
        target = opts.pop("target_ongoing_requests", 2.0)
        if opts:
            raise InvalidParameterError(next(iter(opts)), "not an option of the default policy")
        AutoscalingConfig(min_replicas=lo, max_replicas=hi, **own)  # bounds and delays, checked alike
        return {**serve, **own, "target_ongoing_requests": float(target)}
    if kind != "flotilla":
        raise InvalidParameterError("policy", f"must be 'flotilla' or 'default', got {kind!r}")
    known = {f.name for f in fields(AutoscalingConfig)}
    for key in opts:
        if key not in known:
            raise InvalidParameterError(key, f"unknown autoscaling option; known: {sorted(known)}")
    check_pool_options(opts)
    AutoscalingConfig(min_replicas=lo, max_replicas=hi, **opts)
    return {**serve, "upscale_delay_s": 0.0, "downscale_delay_s": 0.0,
            "policy": {"policy_function": POLICY_PATH, "policy_kwargs": opts}}
