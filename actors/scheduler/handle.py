"""``SchedulerHandle``: how a replica calls its scheduler, wherever that runs.

Two placements implement it (``actors.scheduler.placement``): ``ActorScheduler``
here, a ``SchedulerActor`` called over Ray, and ``actors.scheduler.local``'s
``LocalScheduler``, a ``SchedulerService`` in the replica's own process.

Each method starts its call when called and returns an awaitable of the result
(a Ray ``ObjectRef``, or a task on the service's event loop), as a Ray actor
method's ``.remote`` does. So calls reach the scheduler in the order they are
made, and a call runs to its end even if its caller never awaits it: a submit
whose handler was cancelled still lands, and the abort that follows it finds
the request. The methods mean what ``SchedulerService``'s of the same names do.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, Protocol, TypeVar

import ray
from ray.actor import ActorHandle

from actors.api import EngineStats, HealthStatus, PrefillResult, StepMessage
from actors.commands import Command
from actors.config import EngineConfig
from actors.scheduler.actor import SchedulerActor
from scheduling.sampling_params import SamplingParams

R = TypeVar("R")


class SchedulerHandle(Protocol):
    """A replica's scheduler: every call starts at once; await it for the result (module docstring)."""

    def submit(self, request_id: str, prompt: str | list[int], params: SamplingParams,
               namespace: str | None = None, *, consumer_id: str) -> Awaitable[int]: ...

    def submit_prefilled(self, result: PrefillResult, prompt_ids: list[int], params: SamplingParams,
                         waited_s: float, *, consumer_id: str) -> Awaitable[int]: ...

    def prefill(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> Awaitable[PrefillResult]: ...

    def cached_prefix_tokens(self, prompt_ids: list[int], namespace: str | None = None) -> Awaitable[int]: ...

    def abort(self, request_id: str) -> Awaitable[bool]: ...

    def command(self, cmd: Command[R]) -> Awaitable[R]:
        """A control command for the scheduler (``AddLoRA``, ``RemoveLoRA``: ``SchedulerService.command``)."""
        ...

    def loras(self) -> Awaitable[list[str]]: ...

    def next_outputs(self, consumer_id: str, timeout_s: float) -> Awaitable[list[StepMessage]]: ...

    def stats(self) -> Awaitable[EngineStats]: ...

    def health(self) -> Awaitable[HealthStatus]: ...

    def close(self) -> None:
        """Synchronous teardown (the replica is being destroyed): the scheduler and its executor end."""


class ActorScheduler:
    """A ``SchedulerActor`` as a ``SchedulerHandle``: each method makes the Ray call and returns its ``ObjectRef``."""

    def __init__(self, actor: ActorHandle) -> None:
        self.actor = actor

    @classmethod
    def start(cls, config: EngineConfig, actor_options: dict[str, Any] | None, *, startup_timeout_s: float,
              role: str = "scheduler actor") -> ActorScheduler:
        """Create the actor (``actor_options``: Ray's, e.g. ``num_gpus``) and wait until it reports healthy.

        Raises ``RuntimeError`` naming ``role`` when it reports not ok, and
        Ray's ``GetTimeoutError`` when it has not answered in ``startup_timeout_s``.
        """
        actor = SchedulerActor.options(**(actor_options or {})).remote(config)
        status: HealthStatus = ray.get(actor.health.remote(), timeout=startup_timeout_s)
        if not status.ok:
            raise RuntimeError(f"the {role} is not healthy: {status.message}")
        return cls(actor)

    def submit(self, request_id: str, prompt: str | list[int], params: SamplingParams,
               namespace: str | None = None, *, consumer_id: str) -> Awaitable[int]:
        return self.actor.submit.remote(request_id, prompt, params, namespace, consumer_id=consumer_id)

    def submit_prefilled(self, result: PrefillResult, prompt_ids: list[int], params: SamplingParams,
                         waited_s: float, *, consumer_id: str) -> Awaitable[int]:
        return self.actor.submit_prefilled.remote(result, prompt_ids, params, waited_s, consumer_id=consumer_id)

    def prefill(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> Awaitable[PrefillResult]:
        return self.actor.prefill.remote(request_id, prompt_ids, params)

    def cached_prefix_tokens(self, prompt_ids: list[int], namespace: str | None = None) -> Awaitable[int]:
        return self.actor.cached_prefix_tokens.remote(prompt_ids, namespace)

    def abort(self, request_id: str) -> Awaitable[bool]:
        return self.actor.abort.remote(request_id)

    def command(self, cmd: Command[R]) -> Awaitable[R]:
        return self.actor.command.remote(cmd)

    def loras(self) -> Awaitable[list[str]]:
        return self.actor.loras.remote()

    def next_outputs(self, consumer_id: str, timeout_s: float) -> Awaitable[list[StepMessage]]:
        return self.actor.next_outputs.remote(consumer_id, timeout_s)

    def stats(self) -> Awaitable[EngineStats]:
        return self.actor.stats.remote()

    def health(self) -> Awaitable[HealthStatus]:
        return self.actor.health.remote()

    def close(self) -> None:
        """Kill the actor, which holds the model and the KV pool."""
        ray.kill(self.actor, no_restart=True)
