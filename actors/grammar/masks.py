"""Apply a step's token masks to its logits: disallowed tokens get -inf, in the rows that have masks.

Why not xgrammar's own CPU kernel: one table lookup per mask byte (a 256 x 8
table of 0 / -inf) and an add take less time a row (docs/design_costs.md),
with bit-identical results (tests/actors/grammar/test_grammar.py).
"""

from __future__ import annotations

import torch

from kvcache.device_copy import as_device_tensor, to_device
from scheduling.batch import TokenMasks

_BITS = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
# Row b: what adding to 8 logits does for mask byte b (bit i set: token 8k + i allowed).
_BYTE_TO_ADD = torch.where(_BITS.bool(), 0.0, float("-inf"))


def apply_token_masks(logits: torch.Tensor, masks: TokenMasks) -> torch.Tensor:
    """``logits`` (rows, vocab) with each masked row's disallowed tokens at -inf (a new tensor)."""
    vocab = logits.shape[1]
    bitmask: torch.Tensor = masks.bitmask
    # Host tensors both: copied without waiting for the device (``kvcache.device_copy``).
    table = to_device(_BYTE_TO_ADD, logits.device).to(logits.dtype)
    # int32 words are little-endian in memory, so byte j of a row holds tokens 8j .. 8j + 7.
    add = table[to_device(bitmask, logits.device).view(torch.uint8).long()].view(len(masks.rows), -1)[:, :vocab]
    out = logits.clone()
    if len(masks.rows) == logits.shape[0]:
        out += add
    else:
        out.index_add_(0, as_device_tensor(masks.rows, torch.long, logits.device), add)
    return out
