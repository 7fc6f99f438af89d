"""Adjust a step's logits before any filter or draw: penalties, then logit bias.

Both take the rows (R, V) that need them and return new tensors; the sampler
calls them only when some row of the batch uses them.
"""

from __future__ import annotations

from itertools import chain

import torch

from kvcache.device_copy import as_device_tensor, to_device
from scheduling.sampling_params import SamplingParams


def apply_penalties(
    logits: torch.Tensor,
    params: list[SamplingParams],
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
) -> torch.Tensor:
    """Return penalised copies of ``logits`` rows (shape (R, V), rows aligned with the lists).

    Repetition penalty (Hugging Face semantics) covers prompt and output
    tokens: positive logits are divided by it, negative ones multiplied.
    Frequency and presence penalties (OpenAI/vLLM semantics) cover output
    tokens only: ``logit -= frequency * count + presence * (count > 0)``.
    Each is skipped when no row uses it (most requests use one at most).
    """
    device, dtype = logits.device, logits.dtype

    def column(values: list[float]) -> torch.Tensor:
        return as_device_tensor(values, dtype, device).unsqueeze(1)

    rep = [p.repetition_penalty for p in params]
    frequency = [p.frequency_penalty for p in params]
    presence = [p.presence_penalty for p in params]
    counts = _token_counts(output_token_ids, logits)
    out = logits.clone()
    if any(r != 1.0 for r in rep):
        seen = (counts + _token_counts(prompt_token_ids, logits)) > 0
        factor = column(rep)
        out = torch.where(seen, torch.where(out > 0, out / factor, out * factor), out)
    if any(frequency):
        out -= column(frequency) * counts.to(dtype)
    if any(presence):
        out -= column(presence) * (counts > 0).to(dtype)
    return out


def apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """``logits`` (R, V) plus each row's ``logit_bias``, out of place; one scatter for every biased row."""
    pairs = [(i, tid, bias) for i, p in enumerate(params) for tid, bias in p.logit_bias]
    rows, cols, values = zip(*pairs, strict=True)
    device = logits.device
    index = (as_device_tensor(rows, torch.long, device), as_device_tensor(cols, torch.long, device))
    return logits.index_put(index, as_device_tensor(values, logits.dtype, device), accumulate=True)


def _token_counts(token_ids: list[list[int]], like: torch.Tensor) -> torch.Tensor:
    """(R, V) int64 counts of each token id in each row's list, on ``like``'s device."""
    num_rows, vocab = like.shape
    # Index built on the host (the lists are there), counted on the device.
    # Sizes come from the lists: bincount's and repeat_interleave's would be
    # read from tensors, a wait for a CUDA device.
    lengths = [len(ids) for ids in token_ids]
    rows = torch.repeat_interleave(torch.arange(num_rows), torch.tensor(lengths), output_size=sum(lengths))
    flat = torch.tensor(list(chain.from_iterable(token_ids)), dtype=torch.long)
    index = to_device(rows * vocab + flat, like.device)
    counts = torch.zeros(num_rows * vocab, dtype=torch.long, device=like.device)
    return counts.index_add_(0, index, torch.ones_like(index)).view(num_rows, vocab)
