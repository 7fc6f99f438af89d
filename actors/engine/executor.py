"""Executors run one ``Batch`` per engine step on the model shards.

``LocalExecutor`` holds the one shard in-process; the Ray executor (one call
per step to every tensor-parallel rank) has the same interface.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import replace
from pathlib import Path

from actors.config import EngineConfig
from actors.runner.lora_manager import LoRAInfo
from kvcache.kv_pool import KVCapacity
from kvcache.kv_transfer import KVLayout, KVPayload
from scheduling.batch import Batch, StepOutput
from scheduling.errors import InvalidParameterError

# How long a read of the expert counts (``Executor.expert_tokens``) may take before stats go without them.
EXPERT_TOKENS_TIMEOUT_S = 2.0


class Executor(ABC):
    """Runs steps; reports the KV capacity the scheduler may hand out."""

    capacity: KVCapacity
    kv_layout: KVLayout  # what its pool's pages hold: the engine checks a prefilled request's KV against it
    model_path: Path
    vocab_size: int
    num_moe_layers: int = 0  # 0: a dense model (or an executor that reads no expert counts: expert_tokens ())

    @abstractmethod
    def execute(self, batch: Batch) -> StepOutput:
        """Run one step and return the sampled tokens (aligned with ``batch.sample_indices``).

        With ``batch.kv_exports``, the output's ``kv_exports`` holds per entry
        a tuple of every rank's ``KVPayload``, in rank order.
        """

    @abstractmethod
    def restart(self) -> None:
        """Rebuild the shards after an ``ExecutorFailure``; the KV pool and LoRA slots start empty."""

    def add_lora(self, name: str, path: str) -> LoRAInfo:
        """Register a LoRA adapter on every shard; a refusal raises ``InvalidParameterError`` and registers nothing.

        This default serves none (an executor without model shards, such as a test's stand-in).
        """
        raise InvalidParameterError("enable_lora", f"{type(self).__name__} serves no LoRA adapters")

    def remove_lora(self, name: str) -> None:
        """Forget an adapter on every shard (no step uses it any more); this default holds none to forget."""
        return None

    def prepare_loras(self, names: list[str]) -> dict[str, str]:
        """Have the next step's adapter loads read on every shard, before the step; adapter -> why one failed.

        Called only for a step that writes adapters into slots (``Batch.lora_loads``). This default holds none.
        """
        return {}

    def expert_tokens(self) -> tuple[tuple[int, ...], ...]:
        """Per MoE layer, per expert, the tokens routed to it since the shards loaded (``ModelRunner.expert_tokens``).

        () for a dense model, or when the counts cannot be read now. Unlike
        every other call, from any thread while a step runs (it reads
        counters, waits for no step), within ``EXPERT_TOKENS_TIMEOUT_S``.
        This default holds no model.
        """
        return ()

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
        return with_rank_exports(out, [out]) if batch.kv_exports or batch.kv_saves else out

    def restart(self) -> None:
        """In-process there is no shard to lose: nothing to rebuild."""

    def add_lora(self, name: str, path: str) -> LoRAInfo:
        return self.runner.add_lora(name, path)

    def remove_lora(self, name: str) -> None:
        self.runner.remove_lora(name)

    def prepare_loras(self, names: list[str]) -> dict[str, str]:
        return self.runner.prepare_loras(names)

    def expert_tokens(self) -> tuple[tuple[int, ...], ...]:
        return self.runner.expert_tokens()

    def shutdown(self) -> None:
        """Nothing to stop in-process; the runner's tensors go with this object."""


def with_rank_exports(out: StepOutput, rank_outputs: list[StepOutput | None]) -> StepOutput:
    """``out`` (rank 0's) with every rank's ``kv_exports`` and ``kv_saves`` zipped: one tuple per
    export (and one for the saved pages), in rank order.

    ``rank_outputs[r]`` is rank r's output; each carries this rank's payload
    of every export of the step, aligned with ``Batch.kv_exports``, and of its ``Batch.kv_saves``.
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
