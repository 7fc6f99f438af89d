"""Faults between a step's planning and its update, for the scheduler-service tests.

In process: ``HeldExportExecutor`` holds the step that exports a prefill's KV
on a ``threading.Event`` (so "the step is running" is a fact of the test, not a
timing); ``FailingImportExecutor`` fails the first step that imports KV part-way
through the copy, as an out-of-memory would.

In a live ``SchedulerActor`` (through ``actor.__ray_call__.remote(fn, ...)``, so no
product hook is needed): ``break_masks`` makes the next token-mask builds raise;
``break_finish`` makes the next steps fail as they finish, before the scheduler's
update; ``break_settling`` makes the scheduler unable to settle any step, the
case the engine cannot recover from.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

import actors.engine.llm_engine
from actors.config import EngineConfig
from actors.engine.executor import LocalExecutor
from kvcache.kv_transfer import KVPayload
from scheduling.batch import Batch, StepOutput, TokenMasks

TIMEOUT_S = 60.0
MASKS_ERROR = "injected: building the token masks failed"
FINISH_ERROR = "injected: the step failed before the scheduler's update"
SETTLE_ERROR = "injected: the scheduler cannot settle a step"
IMPORT_ERROR = "injected: out of memory while copying the imported KV"


class HeldExportExecutor(LocalExecutor):
    """Sets ``entered`` when the first step that exports KV starts, and runs it once ``release`` is set."""

    def __init__(self, config: EngineConfig, *, entered: threading.Event, release: threading.Event) -> None:
        super().__init__(config)
        self.entered, self.release, self.held = entered, release, False

    def execute(self, batch: Batch) -> StepOutput:
        if batch.kv_moves.exports and not self.held:
            self.held = True
            self.entered.set()
            assert self.release.wait(TIMEOUT_S), "the test never released the held step"
        return super().execute(batch)


class FailingImportExecutor(LocalExecutor):
    """The first step that imports KV writes the first page of it, then fails (once)."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.failed = False

    def execute(self, batch: Batch) -> StepOutput:
        if batch.kv_moves.imports and not self.failed:
            self.failed = True
            pages, payloads = batch.kv_moves.imports[0]
            self.runner.pool.write_pages(pages[:1], first_pages(payloads[0], 1))
            raise torch.OutOfMemoryError(IMPORT_ERROR)
        return super().execute(batch)


def first_pages(payload: KVPayload, n: int) -> KVPayload:
    """The first ``n`` pages of ``payload``."""

    def cut(tensors: tuple[torch.Tensor, ...] | None) -> tuple[torch.Tensor, ...] | None:
        return None if tensors is None else tuple(t[:n] for t in tensors)

    k, v = cut(payload.k), cut(payload.v)
    assert k is not None and v is not None
    return KVPayload(k=k, v=v, k_scales=cut(payload.k_scales), v_scales=cut(payload.v_scales),
                     kv_dtype=payload.kv_dtype, dtype=payload.dtype)


def break_masks(service: Any, times: int) -> None:
    """Run in a SchedulerActor: its next ``times`` token-mask builds raise, then they work again."""
    states = service._engine.grammar_states
    build = states.masks
    left = [times]

    def masks(batch: Batch, seq_ids: list[str]) -> TokenMasks | None:
        if left[0] > 0:
            left[0] -= 1
            raise RuntimeError(MASKS_ERROR)
        return build(batch, seq_ids)

    states.masks = masks


def break_finish(service: Any, times: int) -> None:
    """Run in a SchedulerActor: its next ``times`` steps raise in ``finish_step`` before the scheduler's update.

    The hook is the first thing ``finish_step`` calls (``collect_exports``), patched in the actor's process.
    """
    collect = actors.engine.llm_engine.collect_exports
    left = [times]

    def failing(engine: Any, batch: Batch, output: StepOutput) -> None:
        if left[0] > 0:
            left[0] -= 1
            raise RuntimeError(FINISH_ERROR)
        collect(engine, batch, output)

    actors.engine.llm_engine.collect_exports = failing  # type: ignore[assignment]


def break_settling(service: Any) -> None:
    """Run in a SchedulerActor: every ``BatchPolicy.update`` from now on raises (no step can be settled)."""

    def update(batch: Batch, output: StepOutput) -> Any:
        raise RuntimeError(SETTLE_ERROR)

    service._engine.policy.update = update
