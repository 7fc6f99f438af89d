"""Prefill/decode disaggregation, the HTTP side: the ``pd`` app arguments, the prefill pool, the decode side's choice.

The engine's side is ``actors.engine.disaggregation``, the scheduler's
``scheduling.kv_handoff``.

``pd`` in the application args (``split_pd``, which ``build_app`` calls): a
prefill pool and a decode pool in one app.

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
parallelism, and the weights' ``quantization`` and its group size): each
setting as each pool will run it (its own, else the app's, else
``EngineConfig``'s default) is compared at build time and a difference
is refused, naming the setting and both values; the decode side also refuses
a payload that does not match its pool or its weight quantization (a pool
redeployed with other settings may meet the old pool's replicas).

The prefill pool (``PrefillServer``): a prefill replica owns one
``SchedulerActor``. Decode replicas call ``prefill`` through a Serve handle:
it computes the prompt and its first token and returns them with the
prompt's KV pages (``PrefillResult``), which travel back through Ray's object
store. The prompt's pages stay in this replica's prefix cache, so a hot
prefix is computed once per prefill replica. A decode replica that gives up
on a call (``remote_prefill_timeout_s``) cancels it; the request is then
aborted in this replica's scheduler. Autoscaling: ``record_autoscaling_stats``
reports the engine's queue (the prefill pool scales on queued prompt tokens)
and the recent P95 of the time to a prefill result as its TTFT
(``cluster.autoscaling``, ``pool: prefill``).

The decode side (``RemotePrefill``) chooses, per request, between prefilling
in its own replica and on the prefill pool. A prompt goes to the prefill pool
when at least ``min_tokens`` of it are not in this replica's prefix cache (a
short or mostly cached prompt costs less here than its KV costs to move), it
has one sequence and no output constraint. The prefill replica returns the
first token and the prompt's KV (``PrefillResult``, through Ray's object
store); this replica's scheduler then decodes from them
(``SchedulerService.submit_prefilled``).

A prefill replica that dies or fails mid-request is retried once, on whichever
replica Serve routes to; a second failure is a 503 naming the prefill pool.
A replica that hangs (alive, no answer) counts as failed after ``timeout_s``
(``remote_prefill_timeout_s``, default ``DEFAULT_REMOTE_PREFILL_TIMEOUT_S``):
its call is cancelled, which aborts the prefill request there, and retried
likewise. Either way nothing is left behind: a failed prefill request dies with
its replica or is aborted there, and this replica takes no page until the KV
has arrived.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import fields, replace
from typing import Any, cast

from ray import serve
from ray.serve import Application, Deployment
from ray.serve.handle import DeploymentHandle, DeploymentResponse

from actors.api import (
    WEIGHT_QUANTIZATION_FIELDS,
    EngineStats,
    FinishReason,
    LatencyWindow,
    PrefillResult,
    SequenceDelta,
    SequenceTiming,
    check_decode_drafting,
)
from actors.config import EngineConfig, scoped_to_app
from actors.scheduler.handle import ActorScheduler, SchedulerHandle
from apps.outputs.detached import detached
from apps.protocol.errors import APIError
from apps.replica.stats import HEALTH_TIMEOUT_S, STATS_TIMEOUT_S
from cluster.autoscaling_metrics import autoscaling_stats, recent_latency_window
from scheduling.errors import InvalidParameterError
from scheduling.sampling_params import SamplingParams

DEFAULT_REMOTE_PREFILL_MIN_TOKENS = 512
# Generous on purpose: it must catch a hung replica, never a busy one (a long prompt queued behind a
# full prefill batch), and a client still hears back within two attempts of it (docs/disaggregation.md).
DEFAULT_REMOTE_PREFILL_TIMEOUT_S = 60.0
PREFILL_ATTEMPTS = 2


def check_remote_options(min_tokens: int, timeout_s: float) -> None:
    """Refuse ``remote_prefill_min_tokens`` below 1 and a ``remote_prefill_timeout_s`` that is not > 0."""
    if min_tokens < 1:
        raise InvalidParameterError("remote_prefill_min_tokens", f"must be >= 1, got {min_tokens}")
    if isinstance(timeout_s, bool) or not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
        raise InvalidParameterError("remote_prefill_timeout_s", f"must be a number > 0, got {timeout_s!r}")


class RemotePrefill:
    """The prefill pool (a Serve handle to ``PrefillServer``) as seen from one decode replica."""

    def __init__(self, handle: DeploymentHandle, scheduler: SchedulerHandle, *,
                 min_tokens: int = DEFAULT_REMOTE_PREFILL_MIN_TOKENS, timeout_s: float = DEFAULT_REMOTE_PREFILL_TIMEOUT_S,
                 record: Callable[[str, float], None] | None = None) -> None:
        check_remote_options(min_tokens, timeout_s)
        self.handle = handle
        self.scheduler = scheduler
        self.min_tokens = min_tokens
        self.timeout_s = timeout_s
        self.num_remote = 0
        self.num_retries = 0
        self.transfer_bytes = 0
        # ``ReplicaMetrics._record``-shaped: (family name, value); the pd_* families of cluster.metric_families.
        self._record = record or (lambda name, value: None)

    async def wants(self, prompt_ids: list[int], params: SamplingParams) -> bool:
        """Whether this request's prompt should be computed on the prefill pool (never an embedding's: it has
        nothing to decode, so moving its prompt's KV would only add a transfer)."""
        if (params.n != 1 or params.structured_output is not None or params.pooling is not None
                or len(prompt_ids) < self.min_tokens):
            return False
        cached = await self.scheduler.cached_prefix_tokens(prompt_ids)
        return len(prompt_ids) - cached >= self.min_tokens

    async def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams, consumer_id: str) -> int:
        """Prefill remotely, then queue the decode here; returns the prompt length (as ``submit``).

        An attempt fails as a whole (the prefill, or fetching its KV from the
        object store once its replica died) and is then retried with a fresh id.
        """
        last: BaseException | None = None
        for attempt in range(PREFILL_ATTEMPTS):
            start = time.monotonic()
            try:
                result = await self._prefill(f"{request_id}.p{attempt}", prompt_ids, params)
                handed = time.monotonic()
                num = await self.scheduler.submit_prefilled(
                    replace(result, request_id=request_id), prompt_ids, params, handed - start, consumer_id=consumer_id)
            except InvalidParameterError:
                raise  # the request's fault: no other replica would take it either
            except Exception as exc:  # a replica died, failed or hung mid-request: try another
                last = exc
                if attempt + 1 < PREFILL_ATTEMPTS:
                    self.num_retries += 1
                    self._record("pd_prefill_retries", 1)
                continue
            # The KV's trip: the remote call beyond the prefill itself, and the hand-over to our scheduler.
            transfer_s = max(0.0, handed - start - result.prefill_s) + (time.monotonic() - handed)
            self.num_remote += 1
            self.transfer_bytes += result.kv_bytes
            self._record("pd_remote_prefills", 1)
            self._record("pd_kv_transfer_bytes", result.kv_bytes)
            self._record("pd_kv_transfer_seconds", transfer_s)
            return num
        raise APIError(503, f"the prefill pool failed this request {PREFILL_ATTEMPTS} times ({type(last).__name__}: "
                            f"{last}); retry the request", code="prefill_unavailable")

    async def _prefill(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> PrefillResult:
        """One remote prefill; after ``timeout_s`` without a result its call is cancelled and it fails."""
        # A unary method's call: a response, never a stream.
        response = cast(DeploymentResponse[PrefillResult], self.handle.prefill.remote(request_id, prompt_ids, params))
        try:
            result = await asyncio.wait_for(response, self.timeout_s)
        except TimeoutError:
            # Awaiting no more does not stop the call: cancel it, so the replica ends it and its
            # scheduler aborts the request (PrefillServer.prefill), whenever that replica wakes.
            response.cancel()
            raise TimeoutError(f"no prefill result within {self.timeout_s} s") from None
        return result


@serve.deployment(max_ongoing_requests=64, health_check_period_s=10.0)
class PrefillServer:
    """One prefill replica: its own SchedulerActor; ``prefill`` is its one method for decode replicas."""

    def __init__(self, engine: dict[str, Any], *, scheduler_options: dict[str, Any] | None = None,
                 startup_timeout_s: float = 600.0) -> None:
        self.config = scoped_to_app(EngineConfig.from_kwargs(**engine), serve.get_replica_context().app_name)
        self._scheduler = ActorScheduler.start(self.config, scheduler_options, startup_timeout_s=startup_timeout_s,
                                               role="prefill scheduler actor")
        self._latency: LatencyWindow = recent_latency_window()
        self._aborts: set[asyncio.Task[None]] = set()  # aborts of cancelled calls still running

    async def prefill(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> PrefillResult:
        """The prompt's first token and KV (see ``SchedulerService.prefill``)."""
        start = time.monotonic()
        try:
            result = await self._scheduler.prefill(request_id, prompt_ids, params)
        except asyncio.CancelledError:
            # Cancelling the await does not end the actor's call: abort it there, from a task this
            # cancel does not reach (apps.outputs.detached), or its pages stay taken until it finishes.
            task = detached(self._abort(request_id))
            self._aborts.add(task)
            task.add_done_callback(self._aborts.discard)
            raise
        now = time.monotonic()
        # The window reads TTFT from sequence timings: a prefill's is its whole time here.
        timing = SequenceTiming(start, now, now, 1, start)
        delta = SequenceDelta(request_id=request_id, index=0, token_ids=[], text="", logprobs=None,
                              finish_reason=FinishReason.LENGTH, timing=timing)
        self._latency.observe([delta], now)
        return result

    async def _abort(self, request_id: str) -> None:
        with contextlib.suppress(Exception):  # the actor is gone: nothing left to free
            await self._scheduler.abort(request_id)

    async def engine_stats(self) -> EngineStats:
        return await asyncio.wait_for(self._scheduler.stats(), STATS_TIMEOUT_S)

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Queue figures of the engine and the recent P95 time to a prefill result (as TTFT)."""
        stats = await self.engine_stats()
        idle = stats.num_unfinished_requests == 0 and stats.num_waiting == 0
        ttft = 0.0 if idle else self._latency.ms("ttft", 95, time.monotonic())
        return autoscaling_stats(stats, ttft_ms_p95=ttft, tpot_ms_p95=0.0)

    async def check_health(self) -> None:
        status = await asyncio.wait_for(self._scheduler.health(), HEALTH_TIMEOUT_S)
        if not status.ok and not status.restarting:
            raise RuntimeError(f"the prefill scheduler actor cannot serve: {status.message}")

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self._scheduler.close()


POOLS = ("prefill", "decode")
# The decode replicas' options (``LLMServer`` keywords of the same names).
REMOTE_OPTIONS = ("remote_prefill_min_tokens", "remote_prefill_timeout_s")
# The weights' quantization too: KV computed by int8 weights fits a bfloat16 pool and would be cached there.
_SHARED_KV = ("model", "page_size", "kv_cache_dtype", "dtype", "tensor_parallel_size", *WEIGHT_QUANTIZATION_FIELDS)


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


def with_pool(autoscaling: object, pool: str) -> object:
    """The pool's autoscaling dict with ``pool`` set (a non-mapping is left for the validator to refuse)."""
    return {**autoscaling, "pool": pool} if isinstance(autoscaling, dict) else autoscaling
