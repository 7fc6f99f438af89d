"""LoRA on the linear layers: many adapters resident at once, mixed in one batch.

Each LoRA-capable linear layer (``ParallelLinear``) gets a ``LoRAWeights``:
for ``max_loras`` slots, ``A`` of shape ``(slots, in, parts * max_rank)`` and,
per part, ``B[i]`` of shape ``(slots, max_rank, out_i)`` on this rank, where
``parts`` are the projections fused in the layer (q, k, v: 3; gate, up: 2;
o and down: 1) and ``out_i`` part ``i``'s share of the output columns. Part
``i`` of an adapter occupies ranks ``i*max_rank .. i*max_rank + r`` of A's
columns, so one matmul shrinks a token for every part, and each part's B
expands only into its own columns (a B over the whole output would be mostly
zeros: 3x the copies and products for q/k/v). A smaller rank, or a
projection the adapter leaves alone, is zeros. B holds ``scaling * B``
(``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA), so the delta of a token
on slot ``s`` is ``x @ A[s] @ B[s]``.

Tensor parallelism slices like the base layer: column-parallel layers keep
their rows of B (A is whole), row-parallel layers their columns of A (B is
whole) and add their partial delta before the all-reduce, which sums it.

One step's rows are grouped by slot (``LoRAStep``, built once per step on the
host): segments of at most ``segment_len`` tokens of one slot, padded to that
length by repeating a row of the step (its delta is computed and dropped: only
``src`` rows are added back). Every layer then gathers its tokens into ``(segments,
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
from scheduling.lora_slots import NO_LORA


@dataclass(frozen=True)
class LoRAStep:
    """One step's token-to-slot grouping, as device index tensors (see the module docstring).

    ``gather``: (segments, segment_len) token rows (padding repeats the
    segment's first row), ``gather_flat`` the same flattened; ``slots``: each
    segment's slot; ``src``: for each LoRA token, its place in the flattened
    padded layout, None when that is every place in order (no padding:
    nothing to select); ``dst``: its row in the step. ``inverse``: for every
    row of the step, its place in the flattened padded layout, or
    ``segments * segment_len`` (a zero row the layer appends, when
    ``base_rows``) for a base-model row; set when at least half the rows are
    LoRA tokens, where reading every row back in order (a select and an add)
    is cheaper than scattering the LoRA rows (``index_add_``).
    ``slot_range``: ``(first, count)`` when the segments are exactly slots
    ``first .. first+count-1``, one each; ``whole_slot``: the slot of every
    token, when they all share one.
    """

    num_tokens: int
    gather: torch.Tensor
    gather_flat: torch.Tensor
    slots: torch.Tensor
    src: torch.Tensor | None
    dst: torch.Tensor
    inverse: torch.Tensor | None = None
    base_rows: bool = False
    slot_range: tuple[int, int] | None = None
    whole_slot: int | None = None

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
        for slot in sorted(by_slot):
            rows = by_slot[slot]
            for start in range(0, len(rows), seg_len):
                part = rows[start : start + seg_len]
                base = len(gather) * seg_len
                src.extend(range(base, base + len(part)))
                dst.extend(part)
                gather.append(part + [part[0]] * (seg_len - len(part)))
                slots.append(slot)
        consecutive = slots == list(range(slots[0], slots[0] + len(slots)))
        inverse: list[int] | None = None
        if 2 * num_lora >= n:
            inverse = [len(gather) * seg_len] * n  # base rows read the appended zero row
            for place, row in zip(src, dst, strict=True):
                inverse[row] = place
        gather_t = as_device_tensor(gather, torch.long, device)
        return cls(
            num_tokens=n,
            gather=gather_t,
            gather_flat=gather_t.view(-1),
            inverse=None if inverse is None else as_device_tensor(inverse, torch.long, device),
            base_rows=num_lora < n,
            slots=as_device_tensor(slots, torch.long, device),
            src=None if len(src) == len(gather) * seg_len else as_device_tensor(src, torch.long, device),
            dst=as_device_tensor(dst, torch.long, device),
            slot_range=(slots[0], len(slots)) if consecutive else None,
            whole_slot=slots[0] if len(by_slot) == 1 and num_lora == n else None,
        )


class LoRAContext:
    """The step's ``LoRAStep``, shared by every LoRA layer of one model (set by the runner around a forward)."""

    def __init__(self) -> None:
        self.step: LoRAStep | None = None


class LoRAWeights:
    """The resident adapters' A and B of one linear layer (this rank's slice), by slot.

    ``part_sizes``: each fused part's output columns on this rank, in order.
    """

    def __init__(
        self, context: LoRAContext, *, max_loras: int, max_rank: int, part_sizes: list[int], in_features: int,
        dtype: torch.dtype, device: torch.device,
    ) -> None:  # fmt: skip
        self.context = context
        self.max_rank = max_rank
        self.offsets = [sum(part_sizes[:i]) for i in range(len(part_sizes))]
        self.sizes = list(part_sizes)
        self.A = torch.zeros(max_loras, in_features, len(part_sizes) * max_rank, dtype=dtype, device=device)
        self.B = [torch.zeros(max_loras, max_rank, size, dtype=dtype, device=device) for size in part_sizes]

    @property
    def dtype(self) -> torch.dtype:
        return self.A.dtype

    def clear(self, slot: int) -> None:
        self.A[slot].zero_()
        for b in self.B:
            b[slot].zero_()

    def set_part(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Part ``part`` of slot ``slot``: ``a`` (r, in) and ``b`` (out, r), this rank's, B already scaled.

        ``b``'s rows are the layer's whole output on this rank (zeros outside
        the part's own columns, as ``ParallelLinear.lora_slice`` places them);
        the part's own rows are kept.
        """
        r = a.shape[0]
        assert r <= self.max_rank and b.shape[1] == r, (a.shape, b.shape, self.max_rank)
        lo = part * self.max_rank
        self.A[slot, :, lo : lo + r].copy_(a.t())
        own = b.narrow(0, self.offsets[part], self.sizes[part])
        self.B[part][slot, :r, :].copy_(own.t())

    def add_delta(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` plus each LoRA token's ``x @ A @ B`` (``y`` unchanged when the step has none).

        ``y`` is the layer's fresh output: the deltas are added into it in place.
        """
        step = self.context.step
        if step is None:
            return y
        assert x.shape[0] == step.num_tokens, (x.shape, step.num_tokens)
        rank = self.max_rank
        if step.whole_slot is not None:  # every row on one adapter: plain matmuls, no gather
            h = x @ self.A[step.whole_slot]
            for i, b in enumerate(self.B):
                y.narrow(1, self.offsets[i], self.sizes[i]).addmm_(h[:, i * rank : (i + 1) * rank], b[step.whole_slot])
            return y
        if step.slot_range is not None:
            first, count = step.slot_range
            a, bs = self.A.narrow(0, first, count), [b.narrow(0, first, count) for b in self.B]
        else:
            a, bs = self.A.index_select(0, step.slots), [b.index_select(0, step.slots) for b in self.B]
        segments, seg_len = step.gather.shape
        h = torch.bmm(x.index_select(0, step.gather_flat).view(segments, seg_len, -1), a)  # (.., parts * rank)
        if len(bs) > 1:  # part-major, so each part's expand reads a contiguous (segments, seg_len, rank)
            h = h.view(segments, seg_len, len(bs), rank).permute(2, 0, 1, 3).contiguous()
        for i, b in enumerate(bs):
            delta = torch.bmm(h[i] if len(bs) > 1 else h, b).view(segments * seg_len, -1)
            out = y.narrow(1, self.offsets[i], self.sizes[i])
            if step.inverse is not None:  # every row read back in order: base rows from a zero row
                if step.base_rows:
                    delta = F.pad(delta, (0, 0, 0, 1))
                out.add_(delta.index_select(0, step.inverse))
            else:
                if step.src is not None:  # drop the padding rows
                    delta = delta.index_select(0, step.src)
                out.index_add_(0, step.dst, delta)
        return y
