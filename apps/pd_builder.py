"""``pd`` in the application args: a prefill pool and a decode pool in one app (``build_app`` calls this).

    args:
      model: small
      pd:
        remote_prefill_min_tokens: 512     # uncached prompt tokens from which a prompt goes to the prefill pool
        prefill: {num_replicas: 1, cpu_threads: 1}          # or autoscaling: {...} (pool: prefill)
        decode: {autoscaling: {min_replicas: 1, max_replicas: 2}, cpu_threads: 1}   # pool: decode

Each pool's dict holds ``EngineConfig`` fields (they override the app's) and
deployment options: ``num_replicas`` or ``autoscaling`` (the SLO policy, with
``pool`` set to the pool: the prefill pool scales on TTFT and queued prompt
tokens, the decode pool on TPOT and running sequences), ``replica_options``,
``scheduler_options``, ``graceful_shutdown_timeout_s``. The decode pool is the
app's ingress (the OpenAI API, prefix-aware routing as without ``pd``); it
holds a handle to the prefill pool. Both pools must store KV alike
(``kv_cache_dtype``, model, page size): the decode side refuses a payload
that does not match its pool.
"""

from __future__ import annotations

from typing import Any, cast

from ray.serve import Application, Deployment

from actors.kv_handoff import check_decode_drafting
from apps.prefill_server import PrefillServer
from apps.remote_prefill import DEFAULT_REMOTE_PREFILL_MIN_TOKENS
from scheduling.errors import InvalidParameterError

POOLS = ("prefill", "decode")
_SHARED_KV = ("model", "page_size", "kv_cache_dtype", "dtype", "tensor_parallel_size")


def split_pd(args: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], int]:
    """``(prefill pool dict, decode pool dict, remote_prefill_min_tokens)`` from ``args.pop("pd")``."""
    pd = args.pop("pd")
    if not isinstance(pd, dict):
        raise InvalidParameterError("pd", "must be a mapping with 'prefill' and 'decode' pools")
    unknown = set(pd) - {*POOLS, "remote_prefill_min_tokens"}
    if unknown:
        raise InvalidParameterError("pd", f"unknown keys {sorted(unknown)}; known: prefill, decode, "
                                          "remote_prefill_min_tokens")
    pools = []
    for name in POOLS:
        pool = pd.get(name) or {}
        if not isinstance(pool, dict):
            raise InvalidParameterError(f"pd.{name}", "must be a mapping of engine fields and deployment options")
        clash = [k for k in _SHARED_KV if k in pool and k in args and pool[k] != args[k]]
        if clash:
            raise InvalidParameterError(f"pd.{name}", f"{clash[0]} must be the same in both pools (KV moves between them)")
        pools.append(dict(pool))
    check_decode_drafting({**args, **pools[1]}.get("speculative_config"))  # the decode pool's, as it will run
    return pools[0], pools[1], int(pd.get("remote_prefill_min_tokens", DEFAULT_REMOTE_PREFILL_MIN_TOKENS))


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
