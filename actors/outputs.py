"""Plain data the engine emits: per-step deltas and finished request outputs."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduling.batch import TokenLogprobs


@dataclass(frozen=True, slots=True)
class SequenceDelta:
    """What one sequence gained in one step (one message carries a list of these).

    ``index`` is the sequence's place among the request's ``n``.
    ``finish_reason`` is set on the sequence's last delta: "stop", "length",
    "abort" or "error".
    """

    request_id: str
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0


@dataclass(slots=True)
class CompletionOutput:
    """One generated sequence, accumulated."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None


@dataclass(slots=True)
class RequestOutput:
    """A finished request: its prompt and its ``n`` sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)

    def apply(self, delta: SequenceDelta) -> None:
        """Fold one step's delta into the accumulated output."""
        out = self.outputs[delta.index]
        out.text += delta.text
        out.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            if out.logprobs is None:
                out.logprobs = []
            out.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            out.finish_reason = delta.finish_reason
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
