"""The batch policy's limits (``scheduling.policy.BatchPolicy``), validated when built."""

from __future__ import annotations

from dataclasses import dataclass

from scheduling.errors import InvalidParameterError
from scheduling.spec_config import SpeculativeConfig


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Configures the batch policy (``scheduling.policy.BatchPolicy``): what it may put in one step, and how
    it reuses and reclaims KV pages. The name is the user-facing one (the engine's ``scheduler_config()``);
    the policy runs inside the scheduler actor (``actors.scheduler``), which this does not configure.

    ``max_num_batched_tokens`` is the per-step token budget (prefill tokens
    plus one per decode). Without chunked prefill a prompt must fit the budget
    in one step, so the budget must be at least ``max_model_len``.
    Preemption is not configurable: the newest running request goes first
    (see ``scheduling.policy``). ``max_loras``: LoRA adapters resident at
    once (``scheduling.lora_slots``); 0 without LoRA.
    """

    max_model_len: int = 2048
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    page_size: int = 16
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    speculative_config: SpeculativeConfig | None = None
    max_loras: int = 0

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "page_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidParameterError(name, f"must be a positive integer, got {value!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise InvalidParameterError(
                "max_num_batched_tokens",
                f"{self.max_num_batched_tokens} is below max_num_seqs {self.max_num_seqs}: "
                "every running sequence needs at least one token per step",
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise InvalidParameterError(
                "max_num_batched_tokens",
                f"{self.max_num_batched_tokens} is below max_model_len {self.max_model_len}; "
                "without chunked prefill a whole prompt must fit in one step",
            )

    def check_lengths(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Refuse a request whose prompt, or prompt plus ``max_tokens``, does not fit ``max_model_len``.

        ``max_tokens`` 0: an embedding request, which generates nothing, so
        its prompt may fill ``max_model_len``; a generating request needs room
        for at least one new token.
        """
        limit = self.max_model_len
        if num_prompt_tokens == 0:
            raise InvalidParameterError("prompt", "the prompt is empty")
        if num_prompt_tokens + min(max_tokens, 1) > limit:
            raise InvalidParameterError("prompt", f"the prompt has {num_prompt_tokens} tokens; max_model_len is {limit}")
        if num_prompt_tokens + max_tokens > limit:
            raise InvalidParameterError(
                "max_tokens",
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = "
                f"{num_prompt_tokens + max_tokens} exceeds max_model_len {limit}",
            )
