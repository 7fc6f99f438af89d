"""The interface every attention backend over the paged KV pool implements.

A backend is planned once per engine step with that step's layout, then
called once per layer. ``forward`` writes the step's new k/v into their pages
and returns causal attention of each new query over its sequence's pages.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class StepLayout:
    """Per-step sequence layout, in plain Python lists (what ``plan`` receives).

    Aligned per sequence: ``query_lens[i]`` new tokens whose positions are
    ``context_lens[i] - query_lens[i] .. context_lens[i] - 1``; the sequence's
    KV lives in ``page_tables[i]`` (page ``j`` holds positions
    ``j*page_size .. (j+1)*page_size - 1``).
    """

    query_lens: list[int]
    context_lens: list[int]
    page_tables: list[list[int]]


class AttentionBackend(ABC):
    """Paged attention over a ``KVPool``; one instance per engine (shared by all layers)."""

    @abstractmethod
    def plan(self, layout: StepLayout) -> None:
        """Prepare index tensors for this step; called once before the layers run."""

    @abstractmethod
    def forward(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Write k/v of the step's tokens into ``layer_id``'s pages; return attention.

        Shapes: ``q`` is (num_tokens, num_heads, head_dim); ``k`` and ``v`` are
        (num_tokens, num_kv_heads, head_dim). Returns (num_tokens, num_heads, head_dim).
        """
