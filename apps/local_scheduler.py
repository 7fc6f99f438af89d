"""The replica's scheduler in the replica's own process, called like a ``SchedulerActor`` handle.

With ``scheduler_placement: replica`` an ``LLMServer`` builds its
``SchedulerService`` here instead of as a separate actor: the engine loop
runs on the replica's event loop and the forward on its own engine thread,
so a request's submit and every step's deltas cross no process boundary
(no Ray call, no pickling). The rest of the replica is unchanged: it calls
``handle.<method>.remote(...)`` and awaits the result, exactly as with the
actor, and ``StreamFanout`` long-polls ``next_outputs`` the same way.

Threads: the service's state belongs to one event loop (its docstring says
why that needs no further locking). ``remote`` runs the method as a task on
that loop; called from any other thread's loop (Serve may call the stats
hooks elsewhere) it is handed over with ``run_coroutine_threadsafe``.

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
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import replace
from typing import Any

from actors.engine.config import EngineConfig
from actors.remote.cpu_threads import ray_reserved_cpus, usable_cores
from actors.remote.scheduler_actor import SchedulerService

# The service methods a replica calls; anything else is a programming error, not a silent no-op.
METHODS = ("submit", "abort", "next_outputs", "stats", "health", "shutdown", "generate")


SERVE_DEFAULT_REPLICA_CPUS = 1  # Serve's num_cpus for a replica that names none


def with_forward_threads(config: EngineConfig) -> EngineConfig:
    """``config`` with ``cpu_threads`` resolved for a forward in the replica (see the module docstring)."""
    if config.cpu_threads is not None or config.executor != "local":
        return config
    reserved = int(ray_reserved_cpus())
    return replace(config, cpu_threads=reserved if reserved > SERVE_DEFAULT_REPLICA_CPUS else usable_cores())


class _Method:
    """``handle.<name>``: ``remote(*args)`` starts the call and returns an awaitable of its result."""

    def __init__(self, owner: LocalScheduler, name: str) -> None:
        self._owner = owner
        self._name = name

    def remote(self, *args: Any, **kwargs: Any) -> Awaitable[Any]:
        fn: Callable[..., Coroutine[Any, Any, Any]] = getattr(self._owner.service, self._name)
        return self._owner.run(fn(*args, **kwargs))


class LocalScheduler:
    """A ``SchedulerService`` in this process behind the ``SchedulerActor`` handle's call shape."""

    def __init__(self, config: EngineConfig) -> None:
        self.service = SchedulerService(with_forward_threads(config))
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:  # built outside a loop: the first call's loop becomes the service's
            self._loop = None

    def __getattr__(self, name: str) -> _Method:
        if name in METHODS:
            return _Method(self, name)
        raise AttributeError(f"{type(self).__name__} has no method {name!r}")

    def run(self, coro: Coroutine[Any, Any, Any]) -> Awaitable[Any]:
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
