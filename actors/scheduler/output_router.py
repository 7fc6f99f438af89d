"""The scheduler actor's output channel: each step's deltas, routed to the consumer (replica) that owns them.

The channel carries ONE ``StepMessage`` (``actors.api``) per engine step per
consumer, holding every delta of that consumer's requests in the step:
never one Ray object per token per request. A consumer long-polls
``SchedulerActor.next_outputs`` and receives every message queued since its
last call, so it makes at most one call per step.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from dataclasses import dataclass, field

from actors.api import RequestOutput, SequenceDelta, StepMessage


@dataclass(slots=True)
class ConsumerQueue:
    """One consumer's bounded queue of step messages (lives in the scheduler actor)."""

    max_messages: int
    messages: deque[StepMessage] = field(default_factory=deque)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    last_poll: float = field(default_factory=time.monotonic)

    def push(self, first_step: int, last_step: int, deltas: list[SequenceDelta]) -> None:
        """Queue one step's deltas, merging into the newest message when full."""
        if len(self.messages) >= self.max_messages:
            # Merge rather than drop: a lost delta would hang its request.
            old = self.messages.pop()
            first_step, deltas = old.first_step, old.deltas + deltas
        self.messages.append(StepMessage(first_step, last_step, deltas))
        self.ready.set()


class OutputRouter:
    """Routes each step's deltas: one message per consumer, or into a waiting output.

    A request belongs to the consumer that submitted it, or (``None``) to a
    ``generate`` call waiting on a future. Lives on the actor's event loop only.
    """

    def __init__(self, max_messages: int) -> None:
        self.max_messages = max_messages
        self.consumers: dict[str, ConsumerQueue] = {}
        self.owner: dict[str, str | None] = {}  # request id -> consumer (None: a waiter)
        self._remaining: dict[str, int] = {}  # request id -> sequences not yet finished
        self._waiters: dict[str, tuple[RequestOutput, asyncio.Future[RequestOutput]]] = {}

    def register(self, request_id: str, consumer_id: str | None, num_seqs: int) -> None:
        """Route ``request_id``'s deltas to ``consumer_id`` (None: its waiter)."""
        self.owner[request_id] = consumer_id
        self._remaining[request_id] = num_seqs
        if consumer_id is not None and consumer_id not in self.consumers:
            self.consumers[consumer_id] = ConsumerQueue(self.max_messages)

    def wait_for(self, output: RequestOutput) -> asyncio.Future[RequestOutput]:
        """A future resolved with ``output`` once every delta of it has been applied."""
        fut: asyncio.Future[RequestOutput] = asyncio.get_running_loop().create_future()
        self._waiters[output.request_id] = (output, fut)
        return fut

    def forget_waiter(self, request_id: str) -> None:
        self._waiters.pop(request_id, None)

    def publish(self, step: int, deltas: list[SequenceDelta]) -> None:
        """Route one step's deltas (no message for a consumer with none)."""
        per_consumer: dict[str, list[SequenceDelta]] = {}
        for d in deltas:
            rid = d.request_id
            owner = self.owner.get(rid)
            if owner is not None:
                per_consumer.setdefault(owner, []).append(d)
            elif rid in self._waiters:
                out, fut = self._waiters[rid]
                out.apply(d)
                if out.finished:
                    del self._waiters[rid]
                    if not fut.done():
                        fut.set_result(out)
            if d.finish_reason is not None:
                left = self._remaining.get(rid, 1) - 1
                if left <= 0:
                    self._remaining.pop(rid, None)
                    self.owner.pop(rid, None)
                else:
                    self._remaining[rid] = left
        for cid, ds in per_consumer.items():
            consumer = self.consumers.get(cid)
            if consumer is not None:
                consumer.push(step, step, ds)

    async def poll(self, consumer_id: str, timeout_s: float) -> list[StepMessage]:
        """Drain ``consumer_id``'s queue, waiting up to ``timeout_s`` for a first message."""
        consumer = self.consumers.setdefault(consumer_id, ConsumerQueue(self.max_messages))
        consumer.last_poll = time.monotonic()
        if not consumer.messages:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(consumer.ready.wait(), timeout_s)
        consumer.ready.clear()
        consumer.last_poll = time.monotonic()
        messages = list(consumer.messages)
        consumer.messages.clear()
        return messages

    def drop_silent(self, timeout_s: float) -> list[str]:
        """Drop consumers that have not polled for ``timeout_s``; return their requests."""
        cutoff = time.monotonic() - timeout_s
        dead = {cid for cid, c in self.consumers.items() if c.last_poll < cutoff}
        for cid in dead:
            del self.consumers[cid]
        return [rid for rid, owner in self.owner.items() if owner in dead]
