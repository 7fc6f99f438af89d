"""The interface every attention backend over the paged KV pool implements.

A backend is planned once per engine step with that step's layout, then
called once per layer. ``forward`` writes the step's new k/v into their pages
and returns causal attention of each new query over its sequence's pages.

Static-shape decode (the capture/replay hook of CUDA graphs,
``actors.runner.decode_graphs``): ``enable_static_decode`` allocates index
buffers for fixed batch sizes once; ``plan_static_decode`` then fills them
for one decode-only step padded to one of those sizes, and ``forward`` runs
over those buffers alone, so a graph captured over ``forward`` replays
correctly for every later plan of its size. A backend that cannot
(``supports_static_decode`` False) raises ``NotImplementedError``, and
``EngineConfig`` refuses ``cuda_graphs`` with it by name first.

Sliding windows (Mistral, Gemma 2/3, Phi-3, Qwen2/3 with
``use_sliding_window``): every backend takes ``sliding_windows``, one entry
per pool layer (``metadata.check_sliding_windows``). Layer ``l`` with window
``w`` lets a query at position ``p`` see the keys at positions ``k`` with
``p - w < k <= p``: ``w`` keys, itself included, Hugging Face's rule
(``metadata.window_start``). ``None`` (a layer's entry, or the whole
argument) is plain causal attention.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

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

    supports_static_decode: ClassVar[bool] = False

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

    def enable_static_decode(self, batch_sizes: Sequence[int], max_pages_per_seq: int) -> None:
        """Allocate the static buffers of decode steps padded to ``batch_sizes``.

        ``max_pages_per_seq`` bounds one sequence's page table. Padding rows
        use the pool's pad page, so the pool needs one (``KVPool(pad_page=True)``).
        """
        raise NotImplementedError(f"{type(self).__name__} has no static-shape decode")

    def plan_static_decode(self, batch_size: int, layout: StepLayout) -> None:
        """Plan a decode-only step into the static buffers of ``batch_size``.

        ``layout`` has at most ``batch_size`` sequences, each with one query;
        rows past them are padding: one token each on the pad page, whose
        outputs the caller drops. ``forward`` then takes ``batch_size`` rows.
        """
        raise NotImplementedError(f"{type(self).__name__} has no static-shape decode")
