"""The replica's scheduler in the replica's own process: a ``SchedulerHandle`` like the actor's.

With ``scheduler_placement: replica`` an ``LLMServer`` builds its
``SchedulerService`` here instead of as a separate actor: the engine loop
runs on the replica's event loop and the forward on its own engine thread,
so a request's submit and every step's deltas cross no process boundary
(no Ray call, no pickling). The rest of the replica is unchanged: it calls
the same ``SchedulerHandle`` methods (``actors.scheduler.handle``) as
on the actor's ``ActorScheduler``, and ``StreamFanout`` long-polls
``next_outputs`` the same way.

Threads: the service's state belongs to one event loop (its docstring says
why that needs no further locking). Each method starts the service's
coroutine as a task on that loop (``run``); called from any other thread's
loop (Serve may call the stats hooks elsewhere) it is handed over with
``run_coroutine_threadsafe``.

Threads: Serve reserves one CPU for every replica unless told otherwise,
and ``actors.remote.cpu_threads`` would turn that reservation into a one-thread
forward. That default is not a choice of threads, so here the forward takes
``cpu_threads`` if set, else the replica's reserved whole CPUs when they are
more than that default one, else every usable core: what the scheduler actor
(which reserves none) gets.

Faults: an executor failure is handled inside the service (fail, restart);
if the replica process dies, the engine dies with it and Serve replaces the
replica. The shards of a tensor-parallel executor are actors this process
owns, so they end with it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Coroutine
from dataclasses import replace
from typing import Any, TypeVar

from actors.api import EngineStats, HealthStatus, PrefillResult, RequestOutput, StepMessage
from actors.commands import Command
from actors.config import EngineConfig
from actors.remote.cpu_threads import ray_reserved_cpus, usable_cores
from actors.scheduler.actor import SchedulerService
from scheduling.sampling_params import SamplingParams

T = TypeVar("T")

SERVE_DEFAULT_REPLICA_CPUS = 1  # Serve's num_cpus for a replica that names none


def with_forward_threads(config: EngineConfig) -> EngineConfig:
    """``config`` with ``cpu_threads`` resolved for a forward in the replica (see the module docstring)."""
    if config.cpu_threads is not None or config.executor != "local":
        return config
    reserved = int(ray_reserved_cpus())
    return replace(config, cpu_threads=reserved if reserved > SERVE_DEFAULT_REPLICA_CPUS else usable_cores())


class LocalScheduler:
    """A ``SchedulerService`` in this process as a ``SchedulerHandle``; also ``generate`` and ``shutdown``."""

    def __init__(self, config: EngineConfig) -> None:
        self.service = SchedulerService(with_forward_threads(config))
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:  # built outside a loop: the first call's loop becomes the service's
            self._loop = None

    def submit(self, request_id: str, prompt: str | list[int], params: SamplingParams,
               namespace: str | None = None, *, consumer_id: str) -> Awaitable[int]:
        return self.run(self.service.submit(request_id, prompt, params, namespace, consumer_id=consumer_id))

    def submit_prefilled(self, result: PrefillResult, prompt_ids: list[int], params: SamplingParams,
                         waited_s: float, *, consumer_id: str) -> Awaitable[int]:
        return self.run(self.service.submit_prefilled(result, prompt_ids, params, waited_s, consumer_id=consumer_id))

    def prefill(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> Awaitable[PrefillResult]:
        return self.run(self.service.prefill(request_id, prompt_ids, params))

    def cached_prefix_tokens(self, prompt_ids: list[int], namespace: str | None = None) -> Awaitable[int]:
        return self.run(self.service.cached_prefix_tokens(prompt_ids, namespace))

    def abort(self, request_id: str) -> Awaitable[bool]:
        return self.run(self.service.abort(request_id))

    def command(self, cmd: Command[T]) -> Awaitable[T]:
        return self.run(self.service.command(cmd))

    def loras(self) -> Awaitable[list[str]]:
        return self.run(self.service.loras())

    def next_outputs(self, consumer_id: str, timeout_s: float) -> Awaitable[list[StepMessage]]:
        return self.run(self.service.next_outputs(consumer_id, timeout_s))

    def stats(self) -> Awaitable[EngineStats]:
        return self.run(self.service.stats())

    def health(self) -> Awaitable[HealthStatus]:
        return self.run(self.service.health())

    def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                 namespace: str | None = None) -> Awaitable[RequestOutput]:
        """Submit and wait for the finished output (``SchedulerService.generate``)."""
        return self.run(self.service.generate(request_id, prompt, params, namespace))

    def shutdown(self) -> Awaitable[None]:
        """The orderly, awaited teardown (``SchedulerService.shutdown``)."""
        return self.run(self.service.shutdown())

    def run(self, coro: Coroutine[Any, Any, T]) -> Awaitable[T]:
        """Start ``coro`` on the service's loop now; the result is awaitable on the caller's loop."""
        current = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = current
        if current is self._loop:
            return current.create_task(coro)
        return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    def close(self) -> None:
        """Synchronous teardown (the replica is being destroyed): stop the engine thread."""
        self.service.close()
