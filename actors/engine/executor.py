"""Executors run one ``Batch`` per engine step on the model shards.

``LocalExecutor`` holds the one shard in-process; the Ray executor (one call
per step to every tensor-parallel rank) has the same interface.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

from actors.commands import Command
from actors.config import EngineConfig
from kvcache.kv_pool import KVCapacity
from kvcache.kv_transfer import KVLayout, KVPayload
from scheduling.batch import Batch, StepOutput

R = TypeVar("R")

# How long a read of the expert counts (``ReadExpertTokens``) may take before stats go without them.
EXPERT_TOKENS_TIMEOUT_S = 2.0


class Executor(ABC):
    """Runs steps; reports the KV capacity the scheduler may hand out."""

    capacity: KVCapacity
    kv_layout: KVLayout  # what its pool's pages hold: the engine checks a prefilled request's KV against it
    model_path: Path
    vocab_size: int
    num_moe_layers: int = 0  # 0: a dense model (or an executor that reads no expert counts: ReadExpertTokens ())

    @abstractmethod
    def execute(self, batch: Batch) -> StepOutput:
        """Run one step and return the sampled tokens (aligned with ``batch.sample_indices``).

        With ``batch.kv_moves.exports``, the output's ``kv_exports`` holds per entry
        a tuple of every rank's ``KVPayload``, in rank order.
        """

    @abstractmethod
    def restart(self) -> None:
        """Rebuild the shards after an ``ExecutorFailure``; the KV pool and LoRA slots start empty."""

    def command(self, cmd: Command[R]) -> R:
        """Run a control command (``actors.commands``) on every shard; a refusal raises ``InvalidParameterError``
        and leaves no shard changed.

        Only ``ReadExpertTokens`` may come from any thread while a step runs;
        every other command comes between steps, on the engine's thread. This
        default holds no model: ``Command.unserved``.
        """
        return cmd.unserved(type(self).__name__)

    @abstractmethod
    def shutdown(self) -> None:
        """Release the shards and their memory."""


class LocalExecutor(Executor):
    """The whole model in this process (tensor_parallel_size 1)."""

    def __init__(self, config: EngineConfig) -> None:
        from actors.runner.model_runner import ModelRunner

        self.runner = ModelRunner(config)
        self.capacity = self.runner.capacity
        self.kv_layout = KVLayout.of(self.runner.pool)
        self.model_path = self.runner.model_path
        self.vocab_size = self.runner.vocab_size
        self.num_moe_layers = self.runner.num_moe_layers

    def execute(self, batch: Batch) -> StepOutput:
        out = self.runner.execute(batch)
        return with_rank_exports(out, [out]) if batch.kv_moves.exports or batch.kv_moves.saves else out

    def restart(self) -> None:
        """In-process there is no shard to lose: nothing to rebuild."""

    def command(self, cmd: Command[R]) -> R:
        return self.runner.command(cmd)

    def shutdown(self) -> None:
        """Nothing to stop in-process; the runner's tensors go with this object."""


def with_rank_exports(out: StepOutput, rank_outputs: list[StepOutput | None]) -> StepOutput:
    """``out`` (rank 0's) with every rank's ``kv_exports`` and ``kv_saves`` zipped: one tuple per
    export (and one for the saved pages), in rank order.

    ``rank_outputs[r]`` is rank r's output; each carries this rank's payload
    of every export of the step, aligned with ``Batch.kv_moves.exports``, and of its ``Batch.kv_moves.saves``.
    """
    if out.kv_exports is not None:
        per_rank: list[list[KVPayload]] = []
        for rank, rank_out in enumerate(rank_outputs):
            assert rank_out is not None and rank_out.kv_exports is not None, f"rank {rank} returned no kv_exports"
            own = [p for p in rank_out.kv_exports if isinstance(p, KVPayload)]
            assert len(own) == len(rank_out.kv_exports), f"rank {rank} returned exports that are not its own payloads"
            per_rank.append(own)
        out = replace(out, kv_exports=list(zip(*per_rank, strict=True)))
    if out.kv_saves is not None:
        saves = [o.kv_saves if o is not None else None for o in rank_outputs]
        assert all(isinstance(p, KVPayload) for p in saves), "a rank returned no kv_saves payload"
        out = replace(out, kv_saves=tuple(p for p in saves if isinstance(p, KVPayload)))
    return out
