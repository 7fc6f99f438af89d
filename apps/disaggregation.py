"""A decode replica's choice, per request, between prefilling here and on the prefill pool.

A prompt goes to the prefill pool when at least ``min_tokens`` of it are not
in this replica's prefix cache (a short or mostly cached prompt costs less
here than its KV costs to move), it has one sequence and no output
constraint. The prefill replica returns the first token and the prompt's KV
(``PrefillResult``, through Ray's object store); this replica's scheduler
then decodes from them (``SchedulerService.submit_prefilled``).

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
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from actors.engine.disaggregation import PrefillResult
from apps.errors import APIError
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

    def __init__(self, handle: Any, actor: Any, *, min_tokens: int = DEFAULT_REMOTE_PREFILL_MIN_TOKENS,
                 timeout_s: float = DEFAULT_REMOTE_PREFILL_TIMEOUT_S,
                 record: Callable[..., None] | None = None) -> None:
        check_remote_options(min_tokens, timeout_s)
        self.handle = handle
        self.actor = actor
        self.min_tokens = min_tokens
        self.timeout_s = timeout_s
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
                result = await self._prefill(f"{request_id}.p{attempt}", prompt_ids, params)
                handed = time.monotonic()
                num: int = await self.actor.submit_prefilled.remote(
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
        response = self.handle.prefill.remote(request_id, prompt_ids, params)
        try:
            result: PrefillResult = await asyncio.wait_for(response, self.timeout_s)
        except TimeoutError:
            # Awaiting no more does not stop the call: cancel it, so the replica ends it and its
            # scheduler aborts the request (apps.prefill_server), whenever that replica wakes.
            response.cancel()
            raise TimeoutError(f"no prefill result within {self.timeout_s} s") from None
        return result
