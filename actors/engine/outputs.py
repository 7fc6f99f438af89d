"""Plain data the engine emits: per-step deltas and finished request outputs."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduling.batch import TokenLogprobs


@dataclass(frozen=True, slots=True)
class SequenceDelta:
    """What one sequence gained in one step (one message carries a list of these).

    ``index`` is the sequence's place among the request's ``n``.
    ``finish_reason`` is set on the sequence's last delta: "stop", "length",
    "abort" or "error"; with "error", ``error`` says what went wrong.
    ``timing`` is set on the last delta only (one object per finished
    sequence keeps the per-step message small).
    ``embedding``: an embedding request's (``SamplingParams.pooling``) pooled
    vector. Such a request yields exactly one delta, in the step that
    computes its prompt's last token: no tokens, no text, finish reason
    "stop", its prompt length, the vector, and timing whose
    ``first_token_time`` is None (no token: TTFT figures leave it out) and
    whose ``last_token_time`` is when the vector was ready (``e2e_s``); or,
    ended early, the usual "abort"/"error" delta without a vector.
    """

    request_id: str
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    timing: SequenceTiming | None = None
    embedding: list[float] | None = None


@dataclass(frozen=True, slots=True)
class SequenceTiming:
    """When a sequence arrived and produced tokens, on the engine's monotonic clock.

    Only differences are meaningful (the clock is the engine process's
    ``time.monotonic``), which is why the derived latencies are offered too.
    """

    arrival_time: float
    first_token_time: float | None
    last_token_time: float | None
    num_output_tokens: int
    first_scheduled_time: float | None = None  # when it first entered a batch

    @property
    def queue_time_s(self) -> float | None:
        """Time spent waiting before first being scheduled, or None if it never was."""
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def e2e_s(self) -> float | None:
        """Arrival to last token, or None if no token was produced."""
        if self.last_token_time is None:
            return None
        return self.last_token_time - self.arrival_time

    @property
    def ttft_s(self) -> float | None:
        """Time to first token, or None if no token was produced."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first, or None with fewer than two."""
        if self.first_token_time is None or self.last_token_time is None or self.num_output_tokens < 2:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_output_tokens - 1)


@dataclass(slots=True)
class CompletionOutput:
    """One generated sequence, accumulated.

    ``embedding``: for an embedding request (``SamplingParams.pooling``), its
    pooled vector once finished (``text`` and ``token_ids`` stay empty); None
    for a generating request, or one that ended without it (abort, error).
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    error: str | None = None
    embedding: list[float] | None = None


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
            out.error = delta.error
        if delta.embedding is not None:
            out.embedding = delta.embedding
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
