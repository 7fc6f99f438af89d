"""``pd`` in the application args: a prefill pool and a decode pool in one app (``build_app`` calls this).

    args:
      model: small
      pd:
        remote_prefill_min_tokens: 512     # uncached prompt tokens from which a prompt goes to the prefill pool
        remote_prefill_timeout_s: 60       # a prefill call unanswered this long is cancelled and retried once
        prefill: {num_replicas: 1, cpu_threads: 1}          # or autoscaling: {...} (pool: prefill)
        decode: {autoscaling: {min_replicas: 1, max_replicas: 2}, cpu_threads: 1}   # pool: decode

Each pool's dict holds ``EngineConfig`` fields (they override the app's) and
deployment options: ``num_replicas`` or ``autoscaling`` (the SLO policy, with
``pool`` set to the pool: the prefill pool scales on TTFT and queued prompt
tokens, the decode pool on TPOT and running sequences), ``replica_options``,
``scheduler_options``, ``graceful_shutdown_timeout_s``. The decode pool is the
app's ingress (the OpenAI API, prefix-aware routing as without ``pd``); it
holds a handle to the prefill pool. Both pools must store KV alike
(``_SHARED_KV``: model, dtype, page size, ``kv_cache_dtype``, tensor
parallelism): each setting as each pool will run it (its own, else the app's,
else ``EngineConfig``'s default) is compared at build time and a difference
is refused, naming the setting and both values; the decode side also refuses
a payload that does not match its pool.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, cast

from ray.serve import Application, Deployment

from actors.engine.config import EngineConfig
from actors.engine.disaggregation import check_decode_drafting
from apps.disaggregation import (
    DEFAULT_REMOTE_PREFILL_MIN_TOKENS,
    DEFAULT_REMOTE_PREFILL_TIMEOUT_S,
    check_remote_options,
)
from apps.prefill_server import PrefillServer
from scheduling.errors import InvalidParameterError

POOLS = ("prefill", "decode")
# The decode replicas' options (``LLMServer`` keywords of the same names).
REMOTE_OPTIONS = ("remote_prefill_min_tokens", "remote_prefill_timeout_s")
_SHARED_KV = ("model", "page_size", "kv_cache_dtype", "dtype", "tensor_parallel_size")


def split_pd(args: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """``(prefill pool dict, decode pool dict, REMOTE_OPTIONS for the decode replicas)`` from ``args.pop("pd")``."""
    pd = args.pop("pd")
    if not isinstance(pd, dict):
        raise InvalidParameterError("pd", "must be a mapping with 'prefill' and 'decode' pools")
    unknown = set(pd) - {*POOLS, *REMOTE_OPTIONS}
    if unknown:
        raise InvalidParameterError("pd", f"unknown keys {sorted(unknown)}; known: {', '.join((*POOLS, *REMOTE_OPTIONS))}")
    pools = []
    for name in POOLS:
        pool = pd.get(name) or {}
        if not isinstance(pool, dict):
            raise InvalidParameterError(f"pd.{name}", "must be a mapping of engine fields and deployment options")
        pools.append(dict(pool))
    check_pools_agree(args, pools[0], pools[1])
    check_decode_drafting({**args, **pools[1]}.get("speculative_config"))  # the decode pool's, as it will run
    remote = {"remote_prefill_min_tokens": int(pd.get("remote_prefill_min_tokens", DEFAULT_REMOTE_PREFILL_MIN_TOKENS)),
              "remote_prefill_timeout_s": pd.get("remote_prefill_timeout_s", DEFAULT_REMOTE_PREFILL_TIMEOUT_S)}
    check_remote_options(remote["remote_prefill_min_tokens"], remote["remote_prefill_timeout_s"])
    return pools[0], pools[1], remote


def check_pools_agree(args: dict[str, Any], prefill: dict[str, Any], decode: dict[str, Any]) -> None:
    """Refuse pools whose KV would differ: each ``_SHARED_KV`` setting, as each pool will run it, must be equal.

    A pool runs its own value, else the app's, else ``EngineConfig``'s default, so two pools that each set
    a different value (or one that sets a value the other only inherits) are caught, not only a pool that
    contradicts the app.
    """
    engine_fields = {f.name for f in fields(EngineConfig)}

    def resolved(pool: dict[str, Any]) -> EngineConfig:
        return EngineConfig.from_kwargs(**{k: v for k, v in {**args, **pool}.items() if k in engine_fields})

    configs = dict(zip(POOLS, (resolved(prefill), resolved(decode)), strict=True))
    for key in _SHARED_KV:
        values = {name: getattr(config, key) for name, config in configs.items()}
        if values["prefill"] != values["decode"]:
            pool = "prefill" if key in prefill else "decode"
            raise InvalidParameterError(f"pd.{pool}", f"{key} must be the same in both pools (KV moves between "
                                                      f"them): prefill {values['prefill']!r}, decode {values['decode']!r}")


def prefill_app(engine: dict[str, Any], options: dict[str, Any], deploy: dict[str, Any]) -> Application:
    """The bound prefill pool; ``options`` may hold ``scheduler_options`` only (the rest is the deployment's)."""
    extra = set(options) - {"scheduler_options"}
    if extra:
        raise InvalidParameterError("pd.prefill", f"{sorted(extra)} do not apply to the prefill pool")
    deployment = cast(Deployment, PrefillServer)
    return deployment.options(**deploy).bind(engine, **options)


def with_pool(autoscaling: Any, pool: str) -> Any:
    """The pool's autoscaling dict with ``pool`` set (a non-mapping is left for the validator to refuse)."""
    return {**autoscaling, "pool": pool} if isinstance(autoscaling, dict) else autoscaling
