"""Apply a step's token masks to its logits: disallowed tokens get -inf, in the rows that have masks.

Why not xgrammar's own CPU kernel: one table lookup per mask byte (a 256 x 8
table of 0 / -inf) and an add take less time a row (docs/design_costs.md),
with bit-identical results (tests/actors/test_grammar.py).
"""

from __future__ import annotations

import torch

from scheduling.batch import TokenMasks

_BITS = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
# Row b: what adding to 8 logits does for mask byte b (bit i set: token 8k + i allowed).
_BYTE_TO_ADD = torch.where(_BITS.bool(), 0.0, float("-inf"))


def apply_token_masks(logits: torch.Tensor, masks: TokenMasks) -> torch.Tensor:
    """``logits`` (rows, vocab) with each masked row's disallowed tokens at -inf (a new tensor)."""
    vocab = logits.shape[1]
    bitmask: torch.Tensor = masks.bitmask
    table = _BYTE_TO_ADD.to(device=logits.device, dtype=logits.dtype)
    # int32 words are little-endian in memory, so byte j of a row holds tokens 8j .. 8j + 7.
    add = table[bitmask.to(logits.device).view(torch.uint8).long()].view(len(masks.rows), -1)[:, :vocab]
    out = logits.clone()
    if len(masks.rows) == logits.shape[0]:
        out += add
    else:
        index = torch.tensor(masks.rows, device=logits.device)
        out.index_add_(0, index, add)
    return out
