"""Reference paged attention in plain torch (the CPU backend).

Per step, ``plan`` builds every index tensor once (slot mapping for the
write, page gathers, masks; see ``attention_metadata``). Per layer,
``forward`` is a handful of big ops: one ``index_copy_`` each for k and v,
then per attention group one page gather each for k and v, one
``scaled_dot_product_attention`` and, only for mixed steps, one scatter of the
outputs back into step order. No per-sequence Python runs in ``forward``.

GQA/MQA without copying K/V per query head: the ``group_size`` query heads
that share a kv head are folded into the query axis, so SDPA sees
``(seqs, kv_heads, max_query_len * group_size, head_dim)`` queries against
``(seqs, kv_heads, context, head_dim)`` keys. For decode the fold is a free
view. Groups of equal-length fresh prompts skip the mask and use SDPA's
``is_causal`` with ``enable_gqa`` instead (torch >= 2.5), which skips the
masked half of the work.

Sequences are split into groups (``partition_sequences``) so a long prefill
does not pad dozens of decodes to its length; a decode-only step with similar
contexts is one group. Gathers land in grow-only buffers reused by every
layer and step.

On the CPU (float32/bfloat16, head_dim a multiple of 8), every decode
sequence (query length 1) of a step instead goes to the native
``paged_decode`` kernel (``cpu_kernels``), which reads each sequence's pages
in place: no gather copy, no padding, so all of a step's decodes share one
call whatever their context lengths. Its padded page table and context
lengths are built once per step in ``plan``. Prefill and chunked-prefill
sequences keep the torch path, as does everything when the kernel is off
(``FLOTILLA_CPU_KERNELS=0``) or cannot be built.

Quantized pools (int8, fp8_e4m3; ``kv_quant``): the write quantizes each
token's k and v per kv head (the native ``quantize_write`` on the CPU, else
``kv_quant.quantize_kv`` and two ``index_copy_``), the torch path gathers the
quantized pages and their scales and dequantizes into the model dtype before
SDPA, and the native decode kernel reads the quantized pages in place,
applying each row's scale to its scores and probabilities.

Sliding windows (``sliding_windows``; the rule is in ``backend``): ``plan``
builds, per group, one more mask per distinct window that hides a key of
that group (``AttentionGroup.window_masks``), and a windowed layer's
``forward`` picks it; a window longer than every context of a group costs
nothing and its layers share the group's plain mask or causal path. The
native decode kernel takes the layer's window and starts its page walk at
the window's first key.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from kvcache import cpu_kernels
from kvcache.attention.backend import AttentionBackend, StepLayout
from kvcache.attention.metadata import (
    AttentionGroup,
    build_attention_group,
    build_slot_mapping,
    check_layout,
    check_sliding_windows,
    num_pages_for,
    partition_sequences,
    token_starts,
)
from kvcache.kv_pool import KVPool
from kvcache.kv_quant import quantize_kv


class _DecodeGroup:
    """The ``paged_decode`` kernel's inputs for a step's decode sequences.

    ``page_table`` (num_seqs, max_pages) int32 holds each sequence's used
    pages, padded with 0 (never read: the kernel stops at ``context_lens``);
    ``context_lens`` (num_seqs,) int32; ``token_index`` (num_seqs,) int64 step
    token rows of the sequences, or None when they are the whole step in order.
    """

    __slots__ = ("page_table", "context_lens", "token_index")

    def __init__(
        self, layout: StepLayout, seq_ids: list[int], page_size: int, starts: list[int]
    ) -> None:
        ctxs = [layout.context_lens[s] for s in seq_ids]
        width = num_pages_for(max(ctxs), page_size)
        rows: list[list[int]] = []
        for s, c in zip(seq_ids, ctxs, strict=True):
            used = num_pages_for(c, page_size)
            rows.append(layout.page_tables[s][:used] + [0] * (width - used))
        self.page_table = torch.tensor(rows, dtype=torch.int32)
        self.context_lens = torch.tensor(ctxs, dtype=torch.int32)
        whole_step = len(seq_ids) == len(layout.query_lens)  # all decodes: token i is seq i
        self.token_index = (
            None if whole_step else torch.tensor([starts[s] for s in seq_ids], dtype=torch.int64)
        )


class _StepPlan:
    """What ``plan`` leaves for the layers of one step."""

    __slots__ = ("num_tokens", "slot_mapping", "groups", "decode")

    def __init__(
        self,
        num_tokens: int,
        slot_mapping: torch.Tensor,
        groups: list[AttentionGroup],
        decode: _DecodeGroup | None,
    ) -> None:
        self.num_tokens = num_tokens
        self.slot_mapping = slot_mapping
        self.groups = groups  # torch-path groups
        self.decode = decode  # kernel-path decodes, if any


class TorchPagedAttention(AttentionBackend):
    """Causal paged attention over a ``KVPool`` with torch ops; any device, any page size.

    One instance serves all layers; ``plan`` must be called once per step
    before the layers' ``forward`` calls. ``scale`` defaults to
    ``1 / sqrt(head_dim)``. ``sliding_windows``: one window (or None) per
    pool layer, None for none anywhere (``metadata.check_sliding_windows``).
    Whether decodes use the native CPU kernel is decided once, here
    (``cpu_kernels.get_paged_decode``; the first backend of a process may
    build it).
    """

    def __init__(
        self,
        pool: KVPool,
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float | None = None,
        sliding_windows: Sequence[int | None] | None = None,
    ) -> None:
        if num_kv_heads != pool.num_kv_heads or head_dim != pool.head_dim:
            raise ValueError(
                f"backend num_kv_heads={num_kv_heads}, head_dim={head_dim} do not match the "
                f"pool's {pool.num_kv_heads}, {pool.head_dim}"
            )
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}"
            )
        self.sliding_windows = check_sliding_windows(sliding_windows, pool.num_layers)
        # The windows plan builds masks for, and each layer's as the kernel takes it (0: none).
        self._windows = sorted({w for w in self.sliding_windows if w is not None})
        self._kernel_windows = [0 if w is None else w for w in self.sliding_windows]
        self.pool = pool
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group_size = num_heads // num_kv_heads
        self.scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
        # Flat (num_pages * page_size, kv_heads, head_dim) views for the
        # slot-indexed write; they share storage with the pool's tensors.
        self._flat_k = [c.view(-1, num_kv_heads, head_dim) for c in pool.k_caches]
        self._flat_v = [c.view(-1, num_kv_heads, head_dim) for c in pool.v_caches]
        self._flat_ks = [c.view(-1, num_kv_heads) for c in pool.k_scales or []]
        self._flat_vs = [c.view(-1, num_kv_heads) for c in pool.v_scales or []]
        self._plan: _StepPlan | None = None
        # Gather targets reused by every layer and step (grow-only). Fresh
        # allocations past glibc's mmap threshold (32 MiB) are page-faulted
        # in on every call, which costs more than the gather itself
        # (docs/design_costs.md).
        self._k_buf: torch.Tensor | None = None
        self._v_buf: torch.Tensor | None = None
        self._decode_kernel = cpu_kernels.get_paged_decode(
            pool.device, pool.dtype, head_dim, pool.cache_dtype
        )
        self._quantize_write = (
            cpu_kernels.get_quantize_write(pool.device, pool.dtype, head_dim, pool.cache_dtype)
            if pool.is_quantized
            else None
        )

    @property
    def uses_cpu_kernel(self) -> bool:
        """True when decode sequences run on the native ``paged_decode`` kernel."""
        return self._decode_kernel is not None

    def plan(self, layout: StepLayout) -> None:
        """Build this step's index tensors (on the pool's device)."""
        page_size = self.pool.page_size
        device = self.pool.device
        check_layout(layout, page_size)
        starts = token_starts(layout.query_lens)
        qlens, ctxs = layout.query_lens, layout.context_lens
        decode_ids: list[int] = []
        torch_ids = list(range(len(qlens)))
        if self._decode_kernel is not None:
            decode_ids = [i for i in torch_ids if qlens[i] == 1]
            torch_ids = [i for i in torch_ids if qlens[i] != 1]
        partition = partition_sequences([qlens[i] for i in torch_ids], [ctxs[i] for i in torch_ids])
        groups = [
            build_attention_group(
                layout,
                [torch_ids[j] for j in part],
                page_size,
                self.group_size,
                device,
                starts,
                self.pool.dtype,
                self._windows,
            )
            for part in partition
        ]
        self._plan = _StepPlan(
            num_tokens=sum(qlens),
            slot_mapping=build_slot_mapping(layout, page_size, device),
            groups=groups,
            decode=_DecodeGroup(layout, decode_ids, page_size, starts) if decode_ids else None,
        )
        need = max((g.num_seqs * g.pages_per_seq for g in groups), default=0)
        if self._k_buf is None or self._k_buf.shape[0] < need:
            shape = (need + need // 4, page_size, self.num_kv_heads, self.head_dim)
            self._k_buf = torch.empty(shape, dtype=self.pool.dtype, device=device)
            self._v_buf = torch.empty(shape, dtype=self.pool.dtype, device=device)

    def forward(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Write k/v into ``layer_id``'s pages, return causal attention (tokens, heads, dim).

        ``q``, ``k`` and ``v`` must be in the pool's dtype (the masks are built in it).
        """
        plan = self._plan
        assert plan is not None, "plan() must run before forward()"
        assert q.shape[0] == plan.num_tokens == k.shape[0] == v.shape[0], (
            q.shape,
            k.shape,
            plan.num_tokens,
        )
        self._write(layer_id, k, v, plan.slot_mapping)
        groups, decode = plan.groups, plan.decode
        window = self.sliding_windows[layer_id]
        if decode is None and len(groups) == 1:
            return self._attend(layer_id, q, groups[0], window)
        if decode is not None and decode.token_index is None:
            return self._decode(layer_id, q, decode)  # decode-only step
        out = q.new_empty(plan.num_tokens, self.num_heads, self.head_dim)
        for group in groups:
            assert group.token_index is not None
            out.index_copy_(0, group.token_index, self._attend(layer_id, q, group, window))
        if decode is not None:
            assert decode.token_index is not None
            out.index_copy_(0, decode.token_index, self._decode(layer_id, q, decode))
        return out  # also the empty step's (0, heads, dim) result

    def _write(self, layer_id: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Store the step's k and v at their slots (quantized first, for a quantized pool)."""
        if not self.pool.is_quantized:
            self._flat_k[layer_id].index_copy_(0, slots, k)
            self._flat_v[layer_id].index_copy_(0, slots, v)
            return
        if self._quantize_write is not None:
            self._quantize_write(
                k, v, slots, self._flat_k[layer_id], self._flat_v[layer_id],
                self._flat_ks[layer_id], self._flat_vs[layer_id],
            )  # fmt: skip
            return
        for x, values, scales in ((k, self._flat_k, self._flat_ks), (v, self._flat_v, self._flat_vs)):
            qx, sx = quantize_kv(x, self.pool.kv_dtype)
            # As bytes: torch has no index_copy_ / index_select for float8 on the CPU.
            values[layer_id].view(torch.uint8).index_copy_(0, slots, qx.view(torch.uint8))
            scales[layer_id].index_copy_(0, slots, sx)

    def _scales(self, layer_id: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if self.pool.k_scales is None or self.pool.v_scales is None:
            return None, None
        return self.pool.k_scales[layer_id], self.pool.v_scales[layer_id]

    def _decode(self, layer_id: int, q: torch.Tensor, d: _DecodeGroup) -> torch.Tensor:
        """The native kernel over decode group ``d``; returns (seqs, heads, dim)."""
        assert self._decode_kernel is not None
        qd = q if d.token_index is None else q.index_select(0, d.token_index)
        if qd.stride(-1) != 1:
            qd = qd.contiguous()
        out = qd.new_empty(qd.shape[0], self.num_heads, self.head_dim)
        k_scales, v_scales = self._scales(layer_id)
        self._decode_kernel(
            out,
            qd,
            self.pool.k_caches[layer_id],
            self.pool.v_caches[layer_id],
            d.page_table,
            d.context_lens,
            self.scale,
            k_scales,
            v_scales,
            self._kernel_windows[layer_id],
        )
        return out

    def _gather(self, layer_id: int, pages: torch.Tensor, out: torch.Tensor, *, key: bool) -> torch.Tensor:
        """Pages ``pages`` of layer ``layer_id``'s k (or v) cache into ``out``, in the model dtype."""
        cache = (self.pool.k_caches if key else self.pool.v_caches)[layer_id]
        if not self.pool.is_quantized:
            return torch.index_select(cache, 0, pages, out=out)
        k_scales, v_scales = self._scales(layer_id)
        scales = k_scales if key else v_scales
        assert scales is not None
        # kv_quant.dequantize_kv's arithmetic without its temporaries: the stored values
        # convert exactly (int8 and e4m3 fit in bfloat16), then one product, rounded once.
        out.copy_(cache.view(torch.uint8).index_select(0, pages).view(cache.dtype))
        return out.mul_(scales.index_select(0, pages).unsqueeze(-1))

    def _attend(
        self, layer_id: int, q: torch.Tensor, g: AttentionGroup, window: int | None
    ) -> torch.Tensor:
        """One padded SDPA over group ``g`` for a layer with ``window``; its real rows (tokens, heads, dim)."""
        n, max_q, hd = g.num_seqs, g.max_query_len, self.head_dim
        kvh, gs = self.num_kv_heads, self.group_size
        span = g.pages_per_seq * self.pool.page_size
        rows = g.num_seqs * g.pages_per_seq
        assert self._k_buf is not None and self._v_buf is not None
        # Gathered pages, viewed (n, kvh, context, hd) without a copy; the
        # slice drops the last page's tail nobody may see.
        kg = self._gather(layer_id, g.page_index, self._k_buf[:rows], key=True)
        vg = self._gather(layer_id, g.page_index, self._v_buf[:rows], key=False)
        kg = kg.view(n, span, kvh, hd)[:, : g.max_context_len].transpose(1, 2)
        vg = vg.view(n, span, kvh, hd)[:, : g.max_context_len].transpose(1, 2)
        qg = q if g.q_index is None else q.index_select(0, g.q_index)
        # The window's own mask where it hides a key of this group, else the plain one.
        mask = g.mask if window is None else g.window_masks.get(window, g.mask)
        if g.causal and mask is None:
            assert g.out_rows is None  # equal lengths: nothing padded
            # Fresh equal-length prompts: positions equal row indices, so
            # SDPA's top-left causal flag is exact and no mask is read.
            qh = qg.view(n, max_q, self.num_heads, hd).transpose(1, 2)
            out = F.scaled_dot_product_attention(
                qh, kg, vg, is_causal=True, scale=self.scale, enable_gqa=gs > 1
            )
            return out.transpose(1, 2).reshape(n * max_q, self.num_heads, hd)
        # (n*max_q, heads, hd) -> (n, kvh, max_q*gs, hd); head h = kv head h // gs.
        # A view when max_q == 1, one small copy otherwise.
        qg = qg.view(n, max_q, kvh, gs, hd).transpose(1, 2).reshape(n, kvh, max_q * gs, hd)
        out = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=self.scale)
        out = out.view(n, kvh, max_q, gs, hd).transpose(1, 2).reshape(n * max_q, self.num_heads, hd)
        if g.out_rows is not None:
            out = out.index_select(0, g.out_rows)
        return out
