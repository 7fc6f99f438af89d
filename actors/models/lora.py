"""LoRA on the linear layers: many adapters resident at once, mixed in one batch.

Each LoRA-capable linear layer (``ParallelLinear``) gets a ``LoRAWeights``:
for ``max_loras`` slots, ``A`` of shape ``(slots, in, parts * max_rank)`` and
``B`` of shape ``(slots, parts * max_rank, out)`` on this rank, where
``parts`` is the number of projections fused in the layer (q, k, v: 3; gate,
up: 2; o and down: 1). Part ``i`` of an adapter occupies ranks ``i*max_rank
.. i*max_rank + r`` of A's columns and the matching rows of B, and B's columns
of part ``i``'s outputs only, so one pair of matmuls serves a fused layer; a
smaller rank, or a projection the adapter leaves alone, is zeros. B holds
``scaling * B`` (``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA), so the
delta of a token on slot ``s`` is ``x @ A[s] @ B[s]``.

Tensor parallelism slices like the base layer: column-parallel layers keep
their rows of B (A is whole), row-parallel layers their columns of A (B is
whole) and add their partial delta before the all-reduce, which sums it.

One step's rows are grouped by slot (``LoRAStep``, built once per step on the
host): segments of at most ``segment_len`` tokens of one slot, padded to that
length with a zero row. Every layer then gathers its tokens into ``(segments,
segment_len, in)``, multiplies by each segment's A and B with two batched
matmuls and adds the result back at its tokens: no Python loop over rows or
adapters (punica's SGMV, in torch). Splitting long segments bounds the
padding: ``segments * segment_len <= tokens + distinct_slots * segment_len``
and ``segment_len`` is the step's LoRA tokens over its distinct slots, so the
padded work is at most twice the real (plus one row per slot). Base-model rows (slot -1) take no part.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvcache.device_copy import as_device_tensor

NO_LORA = -1  # the slot of a token served by the base model


@dataclass(frozen=True)
class LoRAStep:
    """One step's token-to-slot grouping, as device index tensors (see the module docstring).

    ``gather``: (segments, segment_len) token rows, ``num_tokens`` for padding
    (a zero row appended to the input); ``slots``: each segment's slot;
    ``src``: for each LoRA token, its place in the flattened padded layout;
    ``dst``: its row in the step.
    """

    num_tokens: int
    gather: torch.Tensor
    slots: torch.Tensor
    src: torch.Tensor
    dst: torch.Tensor

    @classmethod
    def build(cls, token_slots: list[int], device: torch.device) -> LoRAStep | None:
        """Group ``token_slots`` (a slot per step token, ``NO_LORA`` for the base); None if no token has one."""
        by_slot: dict[int, list[int]] = {}
        for row, slot in enumerate(token_slots):
            if slot != NO_LORA:
                by_slot.setdefault(slot, []).append(row)
        if not by_slot:
            return None
        num_lora = sum(len(rows) for rows in by_slot.values())
        seg_len = -(-num_lora // len(by_slot))
        n = len(token_slots)
        gather: list[list[int]] = []
        slots: list[int] = []
        src: list[int] = []
        dst: list[int] = []
        for slot, rows in by_slot.items():
            for start in range(0, len(rows), seg_len):
                part = rows[start : start + seg_len]
                base = len(gather) * seg_len
                src.extend(range(base, base + len(part)))
                dst.extend(part)
                gather.append(part + [n] * (seg_len - len(part)))
                slots.append(slot)
        return cls(
            num_tokens=n,
            gather=as_device_tensor(gather, torch.long, device),
            slots=as_device_tensor(slots, torch.long, device),
            src=as_device_tensor(src, torch.long, device),
            dst=as_device_tensor(dst, torch.long, device),
        )


class LoRAContext:
    """The step's ``LoRAStep``, shared by every LoRA layer of one model (set by the runner around a forward)."""

    def __init__(self) -> None:
        self.step: LoRAStep | None = None


class LoRAWeights:
    """The resident adapters' A and B of one linear layer (this rank's slice), by slot."""

    def __init__(
        self, context: LoRAContext, *, max_loras: int, max_rank: int, parts: int, in_features: int,
        out_features: int, dtype: torch.dtype, device: torch.device,
    ) -> None:  # fmt: skip
        self.context = context
        self.max_rank, self.parts = max_rank, parts
        width = parts * max_rank
        self.A = torch.zeros(max_loras, in_features, width, dtype=dtype, device=device)
        self.B = torch.zeros(max_loras, width, out_features, dtype=dtype, device=device)

    def clear(self, slot: int) -> None:
        self.A[slot].zero_()
        self.B[slot].zero_()

    def set_part(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Part ``part`` of slot ``slot``: ``a`` (r, in) and ``b`` (out, r), this rank's, B already scaled.

        ``b``'s rows are the layer's whole output on this rank (zeros outside
        the part's own columns), so a fused layer places each part itself.
        """
        r = a.shape[0]
        assert r <= self.max_rank and b.shape[1] == r, (a.shape, b.shape, self.max_rank)
        lo = part * self.max_rank
        self.A[slot, :, lo : lo + r].copy_(a.t())
        self.B[slot, lo : lo + r, :].copy_(b.t())

    def add_delta(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` plus each LoRA token's ``x @ A @ B`` (``y`` unchanged when the step has none)."""
        step = self.context.step
        if step is None:
            return y
        assert x.shape[0] == step.num_tokens, (x.shape, step.num_tokens)
        xs = F.pad(x, (0, 0, 0, 1))[step.gather]  # (segments, seg_len, in); the pad row is zeros
        h = torch.bmm(xs, self.A.index_select(0, step.slots))
        delta = torch.bmm(h, self.B.index_select(0, step.slots)).flatten(0, 1)
        return y.index_add(0, step.dst, delta.index_select(0, step.src).to(y.dtype))
