"""A handler cancelled mid-submit (its client left) still aborts what the scheduler took, plain and P/D alike.

``LLMServer``'s own ``_generate``, ``_submit`` and abort path run here against a fake ``SchedulerHandle``, so
the cancel lands exactly where a live storm only lands by chance: after the scheduler took the request and
before its reply reached the handler. A fake call, like a Ray ``ObjectRef``, is taken by its callee when
made and answered when the test opens its gate; awaiting it again waits for the same answer.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Generator
from typing import Any

import pytest

from actors.api import PrefillResult
from apps.inputs.kind import RequestKind
from apps.protocol import models as p
from apps.replica.disaggregation import RemotePrefill
from apps.replica.server import LLMServer
from scheduling.sampling_params import SamplingParams

WAIT_S = 30.0  # bounds every wait of a scenario: a broken handler fails the test instead of hanging it

PROMPT = list(range(40))


class Ref:
    """A call's reply: ready once ``gate`` is set (every await waits for the same reply)."""

    def __init__(self, gate: asyncio.Event, value: Any) -> None:
        self.gate, self.value = gate, value

    def __await__(self) -> Generator[Any, None, Any]:
        return self._reply().__await__()

    async def _reply(self) -> Any:
        await self.gate.wait()
        return self.value


class Method:
    """A Serve handle's method: ``remote(...)`` makes the call."""

    def __init__(self, run: Any) -> None:
        self.run = run

    def remote(self, *args: Any, **kwargs: Any) -> Ref:
        return self.run(*args, **kwargs)  # type: ignore[no-any-return]


class Scheduler:
    """The replica's scheduler: ``submit``/``submit_prefilled`` take the request at once, reply at ``gate``."""

    def __init__(self, *, in_replica: bool = False) -> None:
        self.in_replica = in_replica  # calls return tasks, as actors.scheduler.local's do, not ObjectRef-likes
        self.gate, self.now = asyncio.Event(), asyncio.Event()
        self.now.set()
        self.taken: list[str] = []
        self.aborted: list[str] = []
        self.took = asyncio.Event()

    def submit(self, rid: str, ids: list[int], *_: Any, **__: Any) -> Any:
        return self._take(rid, len(ids))

    def submit_prefilled(self, result: PrefillResult, ids: list[int], *_: Any, **__: Any) -> Any:
        return self._take(result.request_id, len(ids))

    def cached_prefix_tokens(self, ids: list[int]) -> Ref:
        return Ref(self.now, 0)

    def abort(self, rid: str) -> Ref:
        self.aborted.append(rid)
        return Ref(self.now, True)

    def _take(self, request_id: str, num: int) -> Any:
        self.taken.append(request_id)
        self.took.set()
        return asyncio.ensure_future(Ref(self.gate, num)) if self.in_replica else Ref(self.gate, num)


class PrefillPool:
    def __init__(self) -> None:
        now = asyncio.Event()
        now.set()
        self.prefill = Method(
            lambda rid, ids, params: Ref(now, PrefillResult(rid, 7, None, (), len(ids), 0, 0, 0.0, (None, None))))


class Fanout:
    consumer_id = "c"
    num_open = 0

    def open(self, request_id: str, queue: Any = None) -> asyncio.Queue[Any]:
        return asyncio.Queue()

    def close(self, request_id: str) -> None:
        pass


def replica(scheduler: Scheduler, pd: bool) -> Any:
    """An ``LLMServer`` with fake parts in place of its scheduler actor, output fan-out and prefill pool."""
    server: Any = object.__new__(LLMServer.func_or_class)
    server._scheduler, server._fanout, server._tasks = scheduler, Fanout(), set()
    server._remote = RemotePrefill(PrefillPool(), scheduler, min_tokens=1) if pd else None
    server._admitting = 0

    async def inputs(request: Any, kind: RequestKind) -> tuple[Any, str, list[list[int]], list[SamplingParams]]:
        server._admitting += 1  # as the real one: admitted, its slot held until the streams open
        return p.CompletionRequest(prompt="x"), "tiny", [PROMPT], [SamplingParams(max_tokens=8)]

    server._inputs = inputs
    return server


@pytest.mark.parametrize(("pd", "in_replica"), [(False, False), (True, False), (False, True)],
                         ids=["plain", "pd", "scheduler-in-replica"])
def test_a_handler_cancelled_after_the_scheduler_took_its_request_aborts_it(pd: bool, in_replica: bool) -> None:
    async def scenario() -> tuple[list[str], list[str]]:
        scheduler = Scheduler(in_replica=in_replica)
        server = replica(scheduler, pd)
        handler = asyncio.create_task(server._generate(None, RequestKind.COMPLETION))
        # The scheduler holds the request; its reply is not back yet (bounded: a handler that failed before
        # submitting would leave this waiting for ever).
        took = asyncio.ensure_future(scheduler.took.wait())
        await asyncio.wait({took, handler}, timeout=WAIT_S, return_when=asyncio.FIRST_COMPLETED)
        assert took.done(), f"the handler never submitted: {handler.exception() if handler.done() else 'stuck'}"
        handler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await handler
        scheduler.gate.set()  # the reply arrives after the client left
        while server._tasks:  # the detached aborts
            done, _ = await asyncio.wait(set(server._tasks), timeout=WAIT_S)
            assert done, "a detached abort is stuck"
        assert server._admitting == 0  # the slot passed to the open stream
        return scheduler.taken, scheduler.aborted

    taken, aborted = asyncio.run(scenario())
    assert len(taken) == 1 and aborted == taken, f"taken {taken}, aborted {aborted}: the request was left running"
