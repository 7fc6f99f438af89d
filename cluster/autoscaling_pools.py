"""The autoscaling config, and what counts as load for each pool of replicas.

``decide`` (``cluster.autoscaling``) turns two signals into replica counts:
``pressure`` (above 1 asks for more replicas, proportionally) and ``is_idle``
(may give one back). Which figures feed them depends on ``AutoscalingConfig.pool``:

- ``None`` (one kind of replica, prefill and decode together): pressure =
  max(mean waiting requests / ``target_queue_per_replica``, worst TTFT P95 /
  ``slo_ttft_ms``, worst TPOT P95 / ``slo_tpot_ms``); idle when every queue is
  empty and every P95 (and KV use by running requests) is within ``headroom``.
- ``"prefill"`` (prefill/decode disaggregation: replicas that compute prompts
  and hand their KV on): pressure = max(mean queued prompt tokens /
  ``target_prompt_tokens_per_replica``, worst TTFT P95 / ``slo_ttft_ms``);
  idle when no prompt token is queued anywhere and every TTFT P95 is within
  headroom. Queued prompt *tokens*, not requests: one 30k-token prompt is more
  prefill work than twenty chat turns. TPOT means nothing here (a
  prefill replica samples one token per request).
- ``"decode"`` (replicas that receive the KV and decode): pressure = max(mean
  running sequences / ``target_running_per_replica``, worst TPOT P95 /
  ``slo_tpot_ms``, mean waiting requests / ``target_queue_per_replica``). The
  last term covers a replica whose batch is capped (``max_num_seqs`` or KV
  pages) below the running target: its arrivals wait for a slot, and only the
  waiting queue shows it. Queued prompt tokens and TTFT are ignored, since
  they are the prefill pool's work. Idle when no request waits, every TPOT P95 and
  KV use is within headroom, and the running sequences would fit one replica
  fewer at ``headroom * target_running_per_replica`` each. Counting one replica fewer
  keeps the dead band: a down step never by itself makes pressure exceed 1,
  which would scale straight back up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from cluster.autoscaling_metrics import ReplicaLoad
from scheduling.errors import InvalidParameterError

Pool = Literal["prefill", "decode"]
POOLS: tuple[Pool, ...] = ("prefill", "decode")

# The targets each pool reads; a pool rejects the others (``check_pool_options``) rather than
# ignore a value a user set on purpose.
_POOL_TARGETS: dict[str | None, frozenset[str]] = {
    None: frozenset({"target_queue_per_replica", "slo_ttft_ms", "slo_tpot_ms"}),
    "prefill": frozenset({"target_prompt_tokens_per_replica", "slo_ttft_ms"}),
    "decode": frozenset({"target_running_per_replica", "slo_tpot_ms", "target_queue_per_replica"}),
}
_ALL_TARGETS = frozenset(key for keys in _POOL_TARGETS.values() for key in keys)


@dataclass(frozen=True, slots=True)
class AutoscalingConfig:
    """Bounds, targets and timing of the SLO-aware policy, validated when built.

    ``pool`` picks the signals (module docstring); the app builder sets it on
    a disaggregated app's prefill and decode deployments. Defaults of the
    pool targets:

    - ``target_prompt_tokens_per_replica`` 4096: two full prefill steps at the
      default ``max_num_batched_tokens`` (2048). A deeper backlog means a new
      prompt waits more than two steps behind others before its own prefill
      starts, and this shows before the TTFT P95 does (that only counts finished
      requests).
    - ``target_running_per_replica`` 32: the replica's ``max_num_seqs`` is not
      known here. 32 sequences keep one GPU's decode of a small or mid-size model in
      its memory-bound regime, where TPOT barely grows with the batch. Above it
      TPOT rises with every sequence added. The TPOT term catches a model
      that saturates sooner, and the waiting term a ``max_num_seqs`` below 32.
      The builder should set it from ``max_num_seqs`` when it knows that.
    """

    min_replicas: int = 1
    max_replicas: int = 1
    target_queue_per_replica: float = 4.0
    slo_ttft_ms: float = 2000.0
    slo_tpot_ms: float = 100.0
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 300.0
    headroom: float = 0.7
    max_step_up: int = 4
    pool: Pool | None = None
    target_prompt_tokens_per_replica: float = 4096.0
    target_running_per_replica: float = 32.0

    def __post_init__(self) -> None:
        if self.min_replicas < 0:
            raise InvalidParameterError("min_replicas", f"must be >= 0, got {self.min_replicas}")
        if self.max_replicas < max(1, self.min_replicas):
            raise InvalidParameterError(
                "max_replicas",
                f"must be >= 1 and >= min_replicas ({self.min_replicas}), got {self.max_replicas}",
            )
        for name in sorted(_ALL_TARGETS):
            value = getattr(self, name)
            if not value > 0 or math.isinf(value):
                raise InvalidParameterError(name, f"must be a finite number > 0, got {value}")
        for name in ("upscale_delay_s", "downscale_delay_s"):
            value = getattr(self, name)
            if not value >= 0 or math.isinf(value):
                raise InvalidParameterError(name, f"must be a finite number >= 0, got {value}")
        if not 0 < self.headroom < 1:
            raise InvalidParameterError("headroom", f"must be in (0, 1), got {self.headroom}")
        if self.max_step_up < 1:
            raise InvalidParameterError("max_step_up", f"must be >= 1, got {self.max_step_up}")
        if self.pool is not None and self.pool not in POOLS:
            raise InvalidParameterError("pool", f"must be one of {list(POOLS)} or None, got {self.pool!r}")


def check_pool_options(options: dict[str, Any]) -> None:
    """Reject a target that ``options``' pool never reads, naming it (e.g. ``slo_ttft_ms`` on decode)."""
    pool = options.get("pool")
    if pool is not None and pool not in POOLS:
        raise InvalidParameterError("pool", f"must be one of {list(POOLS)} or None, got {pool!r}")
    used = _POOL_TARGETS[pool]
    for key in options:
        if key in _ALL_TARGETS and key not in used:
            raise InvalidParameterError(
                key, f"not read by the {pool or 'default'} pool; it reads {sorted(used)}"
            )


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def pressure(config: AutoscalingConfig, loads: list[ReplicaLoad]) -> float:
    """How far the fleet is over target: above 1.0 means add replicas; 0.0 with no loads."""
    if not loads:
        return 0.0
    if config.pool == "prefill":
        prompt_tokens = _mean([load.num_waiting_prompt_tokens for load in loads])
        ttft = max(load.ttft_p95_ms for load in loads)
        return max(prompt_tokens / config.target_prompt_tokens_per_replica, ttft / config.slo_ttft_ms)
    queue = _mean([load.num_waiting for load in loads]) / config.target_queue_per_replica
    tpot = max(load.tpot_p95_ms for load in loads) / config.slo_tpot_ms
    if config.pool == "decode":
        running = _mean([load.num_running for load in loads])
        return max(running / config.target_running_per_replica, tpot, queue)
    return max(queue, max(load.ttft_p95_ms for load in loads) / config.slo_ttft_ms, tpot)


def is_idle(config: AutoscalingConfig, loads: list[ReplicaLoad]) -> bool:
    """True when one replica fewer would still run within every target with headroom."""
    if not loads:
        return False
    h = config.headroom
    if config.pool == "prefill":
        return all(
            load.num_waiting_prompt_tokens <= 0 and load.ttft_p95_ms <= h * config.slo_ttft_ms
            for load in loads
        )
    if config.pool == "decode":
        # What runs now must fit one replica fewer; a lone replica is judged on its own,
        # as the default pool judges every replica.
        fewer = max(len(loads) - 1, 1)
        fits = sum(load.num_running for load in loads) <= h * config.target_running_per_replica * fewer
        return fits and all(
            load.num_waiting <= 0 and load.tpot_p95_ms <= h * config.slo_tpot_ms and load.kv_usage <= h
            for load in loads
        )
    return all(
        load.num_waiting <= 0
        and load.ttft_p95_ms <= h * config.slo_ttft_ms
        and load.tpot_p95_ms <= h * config.slo_tpot_ms
        and load.kv_usage <= h
        for load in loads
    )
