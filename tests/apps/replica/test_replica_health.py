"""A replica that cannot serve leaves rotation; one that hiccups keeps its streams.

``LLMServer.check_health`` (Serve's probe) against a fake scheduler, and
``StreamFanout``'s handling of failed polls: a transient error is retried with
the streams kept, a dead actor (or errors that persist) ends them.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError

from actors.api import FinishReason, HealthStatus, SequenceDelta, StepMessage
from apps.outputs.stream_fanout import RequestStream, StreamFanout
from apps.protocol.errors import APIError
from apps.replica.server import LLMServer

WAIT_S = 10.0


class _Remote:
    """A fake scheduler method: each call pops the next scripted outcome (a value or an exception)."""

    def __init__(self, script: list[Any], then: Any = None) -> None:
        self.script, self.then, self.calls = script, then, 0

    async def __call__(self, *args: Any) -> Any:
        self.calls += 1
        outcome = self.script.pop(0) if self.script else self.then
        if isinstance(outcome, BaseException):
            raise outcome
        if outcome is None:  # nothing scripted: behave like an idle long poll
            await asyncio.sleep(0.01)
            return []
        return outcome


def _check_health(status: HealthStatus) -> None:
    """Run the deployment's ``check_health`` on a stand-in replica whose actor reports ``status``."""
    cls: Any = LLMServer.func_or_class  # type: ignore[attr-defined]
    method = next(vars(c)["check_health"] for c in cls.__mro__ if "check_health" in vars(c))
    async def no_adapters_to_sync() -> None:
        return None

    replica = SimpleNamespace(metrics=SimpleNamespace(start_reporting=lambda poll: None),
                              _scheduler=SimpleNamespace(health=_Remote([status]), stats=_Remote([])),
                              loras=SimpleNamespace(sync=no_adapters_to_sync))
    asyncio.run(method(replica))


def test_health_check_fails_when_the_executor_restart_failed() -> None:
    with pytest.raises(RuntimeError, match="restart failed: no GPU"):
        _check_health(HealthStatus(False, "executor restart failed: no GPU"))


@pytest.mark.parametrize("status", [HealthStatus(True, "ok"),
                                    HealthStatus(False, "executor restarting after: x", restarting=True)])
def test_health_check_passes_when_ok_or_restarting(status: HealthStatus) -> None:
    _check_health(status)


def _delta(rid: str, text: str, finish: str | None = None) -> SequenceDelta:
    return SequenceDelta(request_id=rid, index=0, token_ids=[1], text=text, logprobs=None,
                         finish_reason=None if finish is None else FinishReason(finish), num_prompt_tokens=3)


def test_a_transient_poll_error_keeps_open_streams() -> None:
    async def scenario() -> None:
        good = [StepMessage(1, 1, [_delta("a", "x", "length")])]
        actor = SimpleNamespace(next_outputs=_Remote([ActorUnavailableError("blip", None), good]))
        fanout = StreamFanout(actor, "c1", fail_after_s=WAIT_S)
        stream = RequestStream("a", fanout.open("a"), n=1, num_prompt_tokens=3)
        delta = await asyncio.wait_for(stream.next(), WAIT_S)
        assert (delta.text, delta.finish_reason) == ("x", "length") and stream.done
        assert actor.next_outputs.calls >= 2
        await fanout.stop()

    asyncio.run(scenario())


def test_a_dead_actor_fails_open_streams_at_once() -> None:
    async def scenario() -> None:
        actor = SimpleNamespace(next_outputs=_Remote([], then=ActorDiedError()))
        fanout = StreamFanout(actor, "c1", fail_after_s=3600.0)  # no grace would end it: death does
        stream = RequestStream("a", fanout.open("a"), n=1, num_prompt_tokens=3)
        with pytest.raises(APIError) as info:
            await asyncio.wait_for(stream.next(), WAIT_S)
        assert info.value.status == 500 and "lost its scheduler" in info.value.message
        await fanout.stop()

    asyncio.run(scenario())


def test_persistent_poll_errors_fail_open_streams_after_the_grace() -> None:
    async def scenario() -> None:
        actor = SimpleNamespace(next_outputs=_Remote([], then=ConnectionError("unreachable")))
        fanout = StreamFanout(actor, "c1", fail_after_s=0.2)
        stream = RequestStream("a", fanout.open("a"), n=1, num_prompt_tokens=3)
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(APIError) as info:
            await asyncio.wait_for(stream.next(), WAIT_S)
        assert loop.time() - start >= 0.2 and "ConnectionError" in info.value.message
        assert actor.next_outputs.calls >= 2, "a failed poll is retried before giving up"
        await fanout.stop()

    asyncio.run(scenario())
