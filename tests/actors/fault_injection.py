"""Fault injection for the scheduler-actor tests: a Ray-side signal board and an executor
that fails or holds the steps the board names. No sleeps: the test and the executor
meet on named asyncio events inside a Ray actor."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from typing import Any

import ray

from actors.engine_config import EngineConfig
from actors.errors import ExecutorFailure
from actors.executor import Executor, LocalExecutor
from scheduling.batch import Batch, StepOutput

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
            from actors.ray_executor import RayExecutor

            self.inner = RayExecutor(config)
        else:
            self.inner = LocalExecutor(config)
        self.capacity, self.model_path, self.vocab_size = (
            self.inner.capacity, self.inner.model_path, self.inner.vocab_size)
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
