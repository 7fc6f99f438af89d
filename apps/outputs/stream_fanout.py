"""One replica's output channel: long-poll the scheduler actor, fan deltas out per request.

Each ``LLMServer`` replica registers with its ``SchedulerActor`` under one
``consumer_id`` and runs ONE background task that calls ``next_outputs`` in a
loop. Every ``StepMessage`` carries all of this replica's deltas for an engine
step; the task puts each delta on the asyncio queue of its request. So the
replica makes at most one Ray call per engine step, however many requests
stream at once (see ``actors.scheduler.output_router``).

Protocol for a request: ``open(request_id)`` BEFORE ``submit`` (so no delta can
arrive for an unknown request), read the queue until every sequence finished,
then ``close(request_id)``. Deltas of requests not open (already closed,
e.g. after a client disconnect) are dropped.

If polling fails, the task retries with a short backoff. Every open request
gets a final ``finish_reason="error"`` delta (so no handler waits forever)
when the actor is dead (``ActorDiedError``: nothing more will come) or polls
have kept failing for ``fail_after_s``; a transient error (a timeout, an
actor briefly unreachable) costs the open streams nothing but a delay.

``EventStreamResponse`` is the SSE response that guarantees a streaming
request is released (aborted if unfinished) when its client goes away.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace

from ray.exceptions import ActorDiedError
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from actors.api import FinishReason, SequenceDelta
from actors.scheduler.handle import SchedulerHandle
from apps.outputs.detached import detached
from apps.protocol.errors import APIError

logger = logging.getLogger(__name__)

# Between failed polls: start short (a blip should cost little), double up to a second (do not spin).
RETRY_DELAY_S = (0.05, 1.0)
# Polls failing this long mean the actor is gone for good, whatever the error says.
FAIL_AFTER_S = 5.0


class StreamFanout:
    """Routes the scheduler actor's step messages to per-request queues (one event loop)."""

    def __init__(self, scheduler: SchedulerHandle, consumer_id: str, *, poll_timeout_s: float = 1.0,
                 observer: Callable[[list[SequenceDelta]], None] | None = None,
                 fail_after_s: float = FAIL_AFTER_S) -> None:
        self._scheduler = scheduler
        self._fail_after_s = fail_after_s
        self._observer = observer  # sees every step's deltas first (metrics)
        self.consumer_id = consumer_id
        self._poll_timeout_s = poll_timeout_s
        self._queues: dict[str, asyncio.Queue[SequenceDelta]] = {}
        self._task: asyncio.Task[None] | None = None

    @property
    def num_open(self) -> int:
        """Requests currently open on this replica."""
        return len(self._queues)

    def start(self) -> None:
        """Start the polling task on the running loop (idempotent; restarts a dead task)."""
        if self._task is None or self._task.done():
            # Detached: the first request's handler starts this task; it must not be cancelled with it.
            self._task = detached(self._run())

    async def stop(self) -> None:
        """Cancel the polling task and wait for it to end."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def cancel(self) -> None:
        """Cancel the polling task without waiting (for synchronous teardown)."""
        if self._task is not None:
            self._task.cancel()

    def open(self, request_id: str,
             queue: asyncio.Queue[SequenceDelta] | None = None) -> asyncio.Queue[SequenceDelta]:
        """The queue that will receive ``request_id``'s deltas; call before submitting it.

        Pass ``queue`` to share one queue among requests (a batch of prompts).
        """
        self.start()
        queue = asyncio.Queue() if queue is None else queue
        self._queues[request_id] = queue
        return queue

    def close(self, request_id: str) -> None:
        """Stop routing ``request_id`` (later deltas are dropped)."""
        self._queues.pop(request_id, None)

    def dispatch(self, deltas: list[SequenceDelta]) -> None:
        """Put each delta on its request's queue; deltas of closed requests are dropped."""
        for delta in deltas:
            queue = self._queues.get(delta.request_id)
            if queue is not None:
                queue.put_nowait(delta)

    def fail_open(self, message: str) -> None:
        """End every open request with an "error" delta (the channel broke)."""
        for rid, queue in list(self._queues.items()):
            queue.put_nowait(SequenceDelta(request_id=rid, index=0, token_ids=[], text="", logprobs=None,
                                            finish_reason=FinishReason.ERROR, error=message))

    async def _run(self) -> None:
        failing_since: float | None = None  # when the current run of failed polls began
        delay = RETRY_DELAY_S[0]
        loop = asyncio.get_running_loop()
        while True:
            try:
                messages = await self._scheduler.next_outputs(self.consumer_id, self._poll_timeout_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                now = loop.time()
                failing_since = now if failing_since is None else failing_since
                if isinstance(exc, ActorDiedError) or now - failing_since >= self._fail_after_s:
                    logger.error("polling the scheduler actor failed: %r; failing open requests", exc)
                    self.fail_open(f"the replica lost its scheduler: {type(exc).__name__}")
                    failing_since = None  # requests opened from now on get their own grace
                else:
                    logger.warning("polling the scheduler actor failed (retrying): %r", exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_DELAY_S[1])
                continue
            failing_since, delay = None, RETRY_DELAY_S[0]
            for message in messages:
                if self._observer is not None:
                    try:
                        self._observer(message.deltas)
                    except Exception:  # metrics must never break the stream
                        logger.exception("the delta observer failed")
                self.dispatch(message.deltas)


class RequestStream:
    """One response's view of the channel: its queue plus what the response needs to count.

    A response is one engine request, or several sharing one queue (a batch
    of prompts, ``request_ids``): choice ``k * n + j`` is sequence ``j`` of
    the ``k``-th request, as OpenAI and vLLM index a batch's choices.
    Deltas come out of ``next``/``next_many`` with that choice index.

    ``next()`` returns the next delta and raises ``APIError`` when the engine
    ended the request with "error" (500) or "abort" (503): the HTTP layer turns
    that into an error response or an SSE error event.
    """

    def __init__(self, request_id: str, queue: asyncio.Queue[SequenceDelta], *, n: int,
                 num_prompt_tokens: int, request_ids: Sequence[str] | None = None) -> None:
        self.request_id = request_id
        self.request_ids = [request_id] if request_ids is None else list(request_ids)
        self._first_choice = {rid: k * n for k, rid in enumerate(self.request_ids)}
        self.queue = queue
        self.n = n * len(self.request_ids)  # choices
        self._n_per_request = n
        self.num_prompt_tokens = num_prompt_tokens
        self.num_completion_tokens = 0
        self._cached: dict[str, int] = {}  # engine request id -> its cached prompt tokens
        self.released = False  # the HTTP layer has let go of it (and aborted it if unfinished)
        self._held: SequenceDelta | None = None  # an error/abort delta next_many() held back
        self.finish_reasons: list[FinishReason | None] = [None] * self.n

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache, over every request of the response."""
        return sum(self._cached.values())

    def unfinished(self) -> list[str]:
        """The engine request ids with a sequence not yet finished."""
        n = self._n_per_request
        return [rid for k, rid in enumerate(self.request_ids)
                if any(r is None for r in self.finish_reasons[k * n:(k + 1) * n])]

    @property
    def done(self) -> bool:
        """Every sequence has finished."""
        return all(r is not None for r in self.finish_reasons)

    async def next(self) -> SequenceDelta:
        """The next delta of any of the request's sequences."""
        if self._held is not None:
            delta, self._held = self._held, None
        else:
            delta = await self.queue.get()
        return self._accept(delta)

    async def next_many(self) -> list[SequenceDelta]:
        """The next delta plus every delta already queued behind it.

        A reader that fell behind (a slow client, a busy proxy) catches up in
        one response chunk instead of one per engine step. An error or abort
        queued behind good deltas is held back for the following call, so the
        good ones are delivered first.
        """
        out = [await self.next()]
        while not self.done and self._held is None and not self.queue.empty():
            delta = self.queue.get_nowait()
            if delta.finish_reason is not None and delta.finish_reason.failed:
                self._held = delta
            else:
                out.append(self._accept(delta))
        return out

    def _accept(self, delta: SequenceDelta) -> SequenceDelta:
        """Count ``delta``; raise ``APIError`` if it ends the request with an error or abort."""
        if delta.finish_reason is FinishReason.ERROR:
            raise APIError(500, f"the engine failed while generating: {delta.error or 'unknown error'}")
        if delta.finish_reason is FinishReason.ABORT:
            raise APIError(503, "the request was aborted by the server", code="request_aborted")
        self.num_completion_tokens += len(delta.token_ids)
        rid = delta.request_id
        self._cached[rid] = max(self._cached.get(rid, 0), delta.num_cached_tokens)
        choice = self._first_choice[rid] + delta.index
        if choice != delta.index:
            delta = replace(delta, index=choice)
        if delta.finish_reason is not None:
            self.finish_reasons[choice] = delta.finish_reason
        return delta


class EventStreamResponse(StreamingResponse):
    """An SSE response whose ``on_close`` always runs, even when cancelled mid-``send``.

    A client that hangs up cancels the response task; if that lands while the
    body generator is suspended at a ``yield``, the generator's ``finally``
    would wait for garbage collection. ``on_close`` (idempotent) aborts now.
    """

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream")
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
