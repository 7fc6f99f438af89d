"""Embedding requests' pooled rows, accumulated over the steps that compute their prompt.

The model runner returns, per embedding request in a step, the float32 sum of
the hidden rows that step computed for it (mean pooling) or the last prompt
token's row (last pooling: only in the step that ends the prompt)
(``StepOutput.pooled``). Chunked prefill splits a long prompt over steps, so a
mean is the sum of every chunk's sum, kept here in float32 until the prompt is
complete, then divided by the prompt's length.

Invariant: a request's chunks arrive in order and back to back (the scheduler
computes a prompt front to back); a chunk starting at token 0 starts afresh,
which is how a preempted request (recomputed from the start) drops what it had.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from scheduling.pooling import Pooling


@dataclass(slots=True)
class _Partial:
    """One request's float32 sum of its first ``num_tokens`` prompt rows."""

    num_tokens: int
    total: torch.Tensor


class EmbeddingSums:
    """Float32 running sums of the embedding requests whose prompt is part computed, by request id."""

    def __init__(self) -> None:
        self._partial: dict[str, _Partial] = {}

    def __len__(self) -> int:
        return len(self._partial)

    def add(self, request_id: str, first_token: int, num_tokens: int, rows_sum: torch.Tensor) -> None:
        """Fold in the sum of rows ``first_token .. first_token + num_tokens`` (a float32 vector)."""
        assert rows_sum.dtype == torch.float32, rows_sum.dtype
        part = self._partial.get(request_id)
        if first_token == 0 or part is None:
            assert first_token == 0, f"{request_id}: pooling starts at token {first_token}, not at the prompt's start"
            self._partial[request_id] = _Partial(num_tokens, rows_sum.clone())
            return
        assert part.num_tokens == first_token, (
            f"{request_id}: a chunk from token {first_token} follows {part.num_tokens} pooled tokens"
        )
        part.total += rows_sum
        part.num_tokens += num_tokens

    def finish(self, request_id: str, pooling: Pooling, num_prompt_tokens: int, row: torch.Tensor) -> list[float]:
        """The request's embedding, from the step that completed its prompt; forgets its sum.

        ``row``: that step's pooled row (its last chunk's sum for "mean", already
        folded in by ``add``; the last prompt token's hidden state for "last").
        """
        if pooling.mode == "mean":
            part = self._partial.pop(request_id)
            assert part.num_tokens == num_prompt_tokens, (
                f"{request_id}: {part.num_tokens} of {num_prompt_tokens} prompt rows pooled"
            )
            vector = part.total / num_prompt_tokens
        else:
            vector = row.float()
        if pooling.normalize:
            vector = F.normalize(vector, p=2.0, dim=0)
        values: list[float] = vector.tolist()
        return values

    def drop(self, request_id: str) -> None:
        """Forget a request that ended before its prompt was pooled (aborted, failed)."""
        self._partial.pop(request_id, None)
