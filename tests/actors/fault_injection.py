"""Fault injection for the scheduler-actor tests: a Ray-side signal board and an executor
that fails or holds the steps the board names. No sleeps: the test and the executor
meet on named asyncio events inside a Ray actor.

For live servers (tests/apps/replica/test_faults.py): ``side_app`` deploys a second Serve
application on the running cluster, ``install_faults`` wraps a running scheduler's
executor in place (through ``__ray_call__``), ``replica_actors``/``shard_handles`` find
what to kill and ``wait_dead`` waits until a kill has landed."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

import ray

from actors.config import EngineConfig
from actors.engine.executor import Executor, LocalExecutor
from actors.errors import ExecutorFailure
from scheduling.batch import Batch, StepOutput

if TYPE_CHECKING:
    from tests.serve_harness import LiveServer

TIMEOUT = 30.0


@ray.remote
class Signals:
    """Named events, a plan of faults by step and the shard handles, shared with the executor."""

    def __init__(self) -> None:
        self.events: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)
        self.plan: dict[int, str] = {}
        self.shards: list[Any] = []

    async def set(self, name: str) -> None:
        self.events[name].set()

    async def wait(self, name: str) -> bool:
        await asyncio.wait_for(self.events[name].wait(), TIMEOUT)
        return True

    async def plan_(self, step: int, kind: str | None = None) -> str | None:
        """Arm ``kind`` for ``step``; without ``kind``, take (and clear) what is armed."""
        if kind is not None:
            self.plan[step] = kind
        return self.plan.pop(step, None) if kind is None else kind

    async def shards_(self, new: list[Any] | None = None) -> list[Any]:
        self.shards = self.shards if new is None else new
        return self.shards


def _gate(control: Any, key: str) -> None:
    """From the executor: say ``key`` is entered, then wait until the test releases it."""
    ray.get(control.set.remote(f"{key}/in"))
    ray.get(control.wait.remote(f"{key}/out"))


class FaultyExecutor(Executor):
    """Local or Ray executor failing/holding the steps ``Signals`` names; reports its shards."""

    def __init__(self, config: EngineConfig, control: Any) -> None:
        self.inner: Executor
        if config.executor == "ray":
            from actors.remote.ray_executor import RayExecutor

            self.inner = RayExecutor(config)
        else:
            self.inner = LocalExecutor(config)
        self.capacity, self.kv_layout, self.model_path, self.vocab_size = (
            self.inner.capacity, self.inner.kv_layout, self.inner.model_path, self.inner.vocab_size)
        self.control, self.num_restarts = control, 0
        ray.get(control.shards_.remote(getattr(self.inner, "shards", [])))

    def execute(self, batch: Batch) -> StepOutput:
        fault = ray.get(self.control.plan_.remote(batch.step))
        if fault == "executor":
            raise ExecutorFailure("model shard 0 died (injected)")
        if fault == "forward":
            raise RuntimeError("injected forward error")
        if fault == "hold":  # lets the test queue requests while this step runs
            _gate(self.control, f"hold-{batch.step}")
        return self.inner.execute(batch)

    def restart(self) -> None:
        self.num_restarts += 1
        _gate(self.control, f"restart-{self.num_restarts}")
        self.inner.restart()
        ray.get(self.control.shards_.remote(getattr(self.inner, "shards", [])))

    def shutdown(self) -> None:
        self.inner.shutdown()


# ------------------------------------------------------------- live servers
# Faults for a SchedulerActor that is already running (one a Serve replica made): the test
# wraps its executor in place through Ray's ``__ray_call__``, so no product hook is needed.
NEXT_STEP = -1  # the ``Signals`` plan key that ``InjectedExecutor`` reads before every step


class InjectedExecutor(Executor):
    """Wraps a running executor; before each step takes the fault armed under ``NEXT_STEP``.

    Kinds: ``forward`` (the step raises, a plain error), ``executor`` (``ExecutorFailure``),
    ``hold:<tag>`` (the step waits at a gate named ``tag``), ``hold-forward:<tag>`` (waits, then
    raises): the holds let a test queue requests while the step is in flight.
    """

    def __init__(self, inner: Executor, control: Any) -> None:
        self.inner, self.control = inner, control
        self.capacity, self.kv_layout = inner.capacity, inner.kv_layout
        self.model_path, self.vocab_size = inner.model_path, inner.vocab_size

    @property
    def shards(self) -> list[Any]:
        return list(getattr(self.inner, "shards", []))

    def execute(self, batch: Batch) -> StepOutput:
        fault = ray.get(self.control.plan_.remote(NEXT_STEP))
        kind, _, tag = (fault or "").partition(":")
        if kind in ("hold", "hold-forward"):
            _gate(self.control, tag)
        if kind == "executor":
            raise ExecutorFailure("model shard 0 died (injected)")
        if kind in ("forward", "hold-forward"):
            raise RuntimeError(f"injected forward error at step {batch.step}")
        return self.inner.execute(batch)

    def restart(self) -> None:
        self.inner.restart()

    def shutdown(self) -> None:
        self.inner.shutdown()


def install_faults(service: Any, control: Any) -> None:
    """Run in a SchedulerActor (``actor.__ray_call__.remote(install_faults, control)``).

    Installing again only swaps the signal board (the executor is wrapped once).
    """
    engine = service._engine
    if isinstance(engine.executor, InjectedExecutor):
        engine.executor.control = control
    else:
        engine.executor = InjectedExecutor(engine.executor, control)


def shard_handles(service: Any) -> list[Any]:
    """Run in a SchedulerActor: the handles of its executor's shards (none for a local executor)."""
    return list(getattr(service._engine.executor, "shards", []))


def replica_actors(app_name: str) -> list[Any]:
    """Handles of the live Serve replicas of application ``app_name`` (one per replica)."""
    found = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name = entry["name"]
        if name.startswith(f"SERVE_REPLICA::{app_name}#"):
            with contextlib.suppress(ValueError):  # gone between the listing and the lookup
                found.append(ray.get_actor(name, namespace=entry["namespace"]))
    return found


def wait_dead(actor: Any, timeout_s: float = TIMEOUT) -> None:
    """Block until calls to ``actor`` fail: ``ray.kill`` returns before the kill lands."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=max(0.1, deadline - time.monotonic()))
        except ray.exceptions.RayActorError:
            return
        except ray.exceptions.GetTimeoutError:
            continue
    raise AssertionError(f"actor still answers {timeout_s} s after ray.kill")


@contextlib.contextmanager
def side_app(base_url: str, name: str, model_dir: str, *, health_check_period_s: float = 10.0,
             **app_args: Any) -> Iterator[LiveServer]:
    """A second Serve application ``name`` at ``/<name>`` on the running cluster (``live``'s).

    One Ray cluster per process: modules that break things get their own application
    (own replica, own named SchedulerActor ``<name>-scheduler``) beside the shared one,
    which they never touch. The application is ``build_app``'s, with a shorter health-check
    period so a replica whose scheduler died is replaced in seconds, not 30.
    """
    from ray import serve
    from ray.serve import Application

    from apps.builder import build_app
    from tests.serve_harness import ACTOR_NAMESPACE, ENGINE, LiveServer, wait_healthy

    actor_name = f"{name}-scheduler"
    args = {"model": model_dir, "served_model_name": "tiny", "num_replicas": 1,
            "scheduler_options": {"name": actor_name, "namespace": ACTOR_NAMESPACE},
            "replica_options": {"num_cpus": 0.1}, **ENGINE, **app_args}
    built = build_app(args)
    # The same deployment (options and constructor arguments kept), with another health-check period.
    app = Application(cast(Any, built)._bound_deployment.options(health_check_period_s=health_check_period_s))
    serve.run(app, name=name, route_prefix=f"/{name}")
    url = f"{base_url}/{name}"
    try:
        wait_healthy(url)
        yield LiveServer(url, actor_name)
    finally:
        serve.delete(name)
