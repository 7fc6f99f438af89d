"""A decode replica's choice, per request, between prefilling here and on the prefill pool.

A prompt goes to the prefill pool when at least ``min_tokens`` of it are not
in this replica's prefix cache (a short or mostly cached prompt costs less
here than its KV costs to move), it has one sequence and no output
constraint. The prefill replica returns the first token and the prompt's KV
(``PrefillResult``, through Ray's object store); this replica's scheduler
then decodes from them (``SchedulerService.submit_prefilled``).

A prefill replica that dies or fails mid-request is retried once, on whichever
replica Serve routes to; a second failure is a 503 naming the prefill pool.
Either way nothing is left behind: a failed prefill request dies with its
replica or is aborted there, and this replica takes no page until the KV
has arrived.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from actors.kv_handoff import PrefillResult
from apps.errors import APIError
from scheduling.errors import InvalidParameterError
from scheduling.sampling_params import SamplingParams

DEFAULT_REMOTE_PREFILL_MIN_TOKENS = 512
PREFILL_ATTEMPTS = 2


class RemotePrefill:
    """The prefill pool (a Serve handle to ``PrefillServer``) as seen from one decode replica."""

    def __init__(self, handle: Any, actor: Any, *, min_tokens: int = DEFAULT_REMOTE_PREFILL_MIN_TOKENS,
                 record: Callable[..., None] | None = None) -> None:
        if min_tokens < 1:
            raise InvalidParameterError("remote_prefill_min_tokens", f"must be >= 1, got {min_tokens}")
        self.handle = handle
        self.actor = actor
        self.min_tokens = min_tokens
        self.num_remote = 0
        self.num_retries = 0
        self.transfer_bytes = 0
        # ``ReplicaMetrics._record``-shaped: (family name, value); the pd_* families of cluster.metric_families.
        self._record = record or (lambda name, value: None)

    async def wants(self, prompt_ids: list[int], params: SamplingParams) -> bool:
        """Whether this request's prompt should be computed on the prefill pool."""
        if params.n != 1 or params.structured_output is not None or len(prompt_ids) < self.min_tokens:
            return False
        cached: int = await self.actor.cached_prefix_tokens.remote(prompt_ids)
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
                result: PrefillResult = await self.handle.prefill.remote(f"{request_id}.p{attempt}", prompt_ids, params)
                handed = time.monotonic()
                num: int = await self.actor.submit_prefilled.remote(
                    replace(result, request_id=request_id), prompt_ids, params, handed - start, consumer_id=consumer_id)
            except InvalidParameterError:
                raise  # the request's fault: no other replica would take it either
            except Exception as exc:  # a replica died or failed mid-request: try another
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
