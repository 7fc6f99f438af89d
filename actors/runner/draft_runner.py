"""The ``draft`` method of speculative decoding: a small model proposes the next tokens greedily.

Two kinds of drafter, one loop:

- a self-draft (``{"method": "draft", "layers": N}``): the target's own first
  N layers, its final norm and head. Those layers' KV for every verified token
  is exactly what the target wrote, so it reads (and writes) the target's pages
  and needs no memory and no catch-up of its own.
- a draft model (``{"method": "draft", "model": ...}``): a separate checkpoint
  with the same vocabulary, with its own KV pool that uses the *same page ids*
  as the target's (page p holds the draft's KV of the tokens whose target KV is
  in page p), so the scheduler's page tables serve both. Every step it runs
  over the step's tokens too (``catch_up``), keeping its KV beside the target's.

``propose`` runs after the step's tokens are sampled: from each sequence's new
last token, m greedy decode steps give m drafts for the sequence's next step.
KV written past the kept tokens is rewritten before anyone attends to it (the
next step recomputes those positions), so nothing needs undoing.
"""

from __future__ import annotations

import torch

from actors.models.decoder import CausalLM
from kvcache import device_copy
from kvcache.attention.backend import AttentionBackend, StepLayout
from kvcache.device_copy import as_device_tensor


class DraftRunner:
    """Greedy drafts from ``model``'s first ``num_layers`` layers (all when None) over ``attn``."""

    def __init__(
        self,
        model: CausalLM,
        attn: AttentionBackend,
        *,
        num_layers: int | None,
        shares_target_kv: bool,
    ) -> None:
        self.model = model
        self.attn = attn
        self.num_layers = num_layers
        self.shares_target_kv = shares_target_kv

    def catch_up(self, input_ids: torch.Tensor, positions: torch.Tensor, layout: StepLayout) -> None:
        """Write the step's tokens into the draft model's own KV (nothing to do for a self-draft)."""
        if self.shares_target_kv:
            return
        self.attn.plan(layout)
        self.model(input_ids, positions, self.attn, self.num_layers)

    def propose(
        self, last_tokens: list[int], positions: list[int], page_tables: list[list[int]], counts: list[int]
    ) -> list[list[int]]:
        """``counts[i]`` greedy drafts after token ``last_tokens[i]`` at ``positions[i]``, per sequence.

        ``page_tables[i]`` covers ``positions[i] + counts[i]`` tokens (the m
        forwards write positions ``positions[i] .. positions[i] + m - 1``).
        """
        device = next(self.model.parameters()).device
        active = [i for i, m in enumerate(counts) if m > 0]
        # Each forward's picks feed the next one on the device; the host reads
        # every step's picks once, at the end (``kvcache.device_copy``).
        ids = as_device_tensor([last_tokens[i] for i in active], torch.long, device)
        picked: list[tuple[list[int], torch.Tensor]] = []  # (sequences, their picks) per forward
        step = 0
        while active:
            pos = [positions[i] + step for i in active]
            self.attn.plan(StepLayout([1] * len(active), [p + 1 for p in pos], [page_tables[i] for i in active]))
            hidden = self.model(ids, as_device_tensor(pos, torch.long, device), self.attn, self.num_layers)
            picks = self.model.compute_logits(hidden).max(dim=-1).indices
            picked.append((active, picks))
            step += 1
            going = [j for j, i in enumerate(active) if counts[i] > step]
            ids = picks if len(going) == len(active) else picks[as_device_tensor(going, torch.long, device)]
            active = [active[j] for j in going]
        drafts: list[list[int]] = [[] for _ in counts]
        host = device_copy.to_host([picks for _, picks in picked]) if picked else []
        for (seqs, _), values in zip(picked, host, strict=True):
            tokens: list[int] = values.tolist()
            for i, token in zip(seqs, tokens, strict=True):
                drafts[i].append(token)
        return drafts
