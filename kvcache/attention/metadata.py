"""Pure functions turning a ``StepLayout`` into the index tensors backends use.

Nothing here touches the KV pool; every function is deterministic in its
inputs, so the builders are tested on CPU against each other and against
dense attention.

Positions: query ``i`` of sequence ``s`` sits at ``context_lens[s] -
query_lens[s] + i``; position ``p`` lives in page ``page_tables[s][p //
page_size]`` at offset ``p % page_size``, i.e. flat slot ``page * page_size +
offset`` of the pool viewed as ``(num_pages * page_size, heads, head_dim)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvcache.attention.backend import StepLayout
from kvcache.device_copy import as_device_tensor


def check_sliding_windows(
    sliding_windows: Sequence[int | None] | None, num_layers: int
) -> tuple[int | None, ...]:
    """A backend's ``sliding_windows`` argument as one entry per layer (all None for None).

    The windows' meaning is ``backend``'s (module docstring); ``window_start``
    applies it.

    Raises:
        ValueError: the sequence's length is not ``num_layers`` (the pool's
            layer count), or an entry is neither None nor an int >= 1.
    """
    if sliding_windows is None:
        return (None,) * num_layers
    if isinstance(sliding_windows, (str, bytes)):  # a str is a Sequence, of characters
        raise ValueError(f"sliding_windows must be a sequence of ints or None, got {sliding_windows!r}")
    windows = tuple(sliding_windows)
    if len(windows) != num_layers:
        raise ValueError(
            f"sliding_windows has {len(windows)} entries, the pool has {num_layers} layers: "
            f"give one window (or None) per layer"
        )
    for layer, w in enumerate(windows):
        # bool is an int subclass: True would read as a window of 1.
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise ValueError(f"sliding_windows[{layer}] = {w!r}: a window must be an int >= 1 or None")
    return windows


def window_start(position: int, window: int | None) -> int:
    """First key position a query at ``position`` sees under ``window`` (None: 0, plain causal).

    ``backend``'s rule (module docstring) as code; the query sees the keys
    ``window_start(p, w) .. p``.
    """
    return 0 if window is None else max(0, position - window + 1)


def window_hides_keys(context_len: int, window: int | None) -> bool:
    """Whether ``window`` hides a key from some query of a sequence of ``context_len`` tokens.

    Its last query (position ``context_len - 1``) sees the most keys, so the
    window matters exactly when that one starts past position 0.
    """
    return window_start(context_len - 1, window) > 0


def num_pages_for(num_tokens: int, page_size: int) -> int:
    """Pages needed to hold ``num_tokens`` tokens."""
    return -(-num_tokens // page_size)


def check_layout(layout: StepLayout, page_size: int) -> None:
    """Assert the layout's invariants (the scheduler guarantees them)."""
    n = len(layout.query_lens)
    assert len(layout.context_lens) == n and len(layout.page_tables) == n, layout
    for q, c, pages in zip(layout.query_lens, layout.context_lens, layout.page_tables, strict=True):
        assert 1 <= q <= c, f"query_len {q} must be in [1, context_len {c}]"
        assert len(pages) * page_size >= c, f"{len(pages)} pages cannot hold {c} tokens"


def build_slot_mapping(
    layout: StepLayout, page_size: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Flat pool slot of every new token, in step token order; int64, (num_tokens,).

    Built on the host and copied to ``device`` without waiting for it (``device_copy``).
    """
    slots: list[int] = []
    for q, c, pages in zip(layout.query_lens, layout.context_lens, layout.page_tables, strict=True):
        if q == 1:  # decode, the common case: no range object per sequence
            p = c - 1
            slots.append(pages[p // page_size] * page_size + p % page_size)
            continue
        for p in range(c - q, c):
            slots.append(pages[p // page_size] * page_size + p % page_size)
    return as_device_tensor(slots, torch.int64, torch.device(device))


# Cost model for splitting sequences into padded attention groups, in
# "query-key pair" units (one query token against one key, all heads, in
# SDPA). A sequence alone costs its causal pairs, q*c - q*q/2 (a fresh
# prompt runs on SDPA's causal path, which skips masked blocks), plus
# KEY_ROW_COST per gathered key row (k and v); inside a padded masked group
# every member pays the full max_q x max_c rectangle. One more group
# (gathers, SDPA, scatter) is charged MIN_WASTE pairs of fixed overhead.
# The constants were set from CPU timings expressed in pairs;
# docs/design_costs.md (entry ``attention_groups``) gives the units measured
# now beside them.
KEY_ROW_COST = 16
MIN_WASTE = 8192
MAX_PADDING_RATIO = 2.0


def partition_sequences(query_lens: Sequence[int], context_lens: Sequence[int]) -> list[list[int]]:
    """Split sequence indices into groups that share one padded attention call.

    Every group pads its queries to its longest query and its keys to its
    longest context. Greedy over sequences sorted by (query_len, context_len)
    descending: a sequence joins the current group unless the padded cost it
    adds is more than ``MAX_PADDING_RATIO`` times its own real cost and that
    waste beats the overhead of another call. So a decode-only step with
    similar contexts is one group, and a long prefill never pads decodes (or
    much shorter prompts) to its length. Each group lists its indices
    ascending, and the groups together cover every index exactly once.
    """
    order = sorted(
        range(len(query_lens)), key=lambda i: (query_lens[i], context_lens[i]), reverse=True
    )
    groups: list[list[int]] = []
    current: list[int] = []
    max_q = max_c = 0
    for i in order:
        q, c = query_lens[i], context_lens[i]
        own = q * c - q * q // 2 + KEY_ROW_COST * c
        new_q = q if q > max_q else max_q
        new_c = c if c > max_c else max_c
        added = (len(current) + 1) * new_c * (new_q + KEY_ROW_COST) - len(current) * max_c * (
            max_q + KEY_ROW_COST
        )
        if current and added > MAX_PADDING_RATIO * own and added - own > MIN_WASTE:
            groups.append(sorted(current))
            current, max_q, max_c = [i], q, c
        else:
            current.append(i)
            max_q, max_c = new_q, new_c
    if current:
        groups.append(sorted(current))
    return groups


@dataclass(frozen=True, slots=True)
class AttentionGroup:
    """Index tensors for one padded attention call over a subset of sequences.

    The call sees queries as ``(num_seqs, max_query_len)`` and keys as
    ``(num_seqs, max_context_len)``; padded query rows repeat their sequence's
    last real row (finite, then dropped) and padded key columns are masked.

    Attributes:
        seq_ids: the step's sequence indices in this group, ascending.
        page_index: (num_seqs * pages_per_seq,) int64 pool pages to gather;
            padding points at page 0, which the mask hides.
        q_index: (num_seqs * max_query_len,) int64 step token rows to gather
            into the padded query block, or None when the step's ``q`` already
            is that block (the group is the whole step with no padding).
        out_rows: rows of the flattened padded output that are real tokens,
            or None when every row is real.
        token_index: step token index of each real row (matching ``out_rows``),
            or None when the group is the whole step in step order.
        causal: every sequence is a fresh prompt of ``max_query_len`` tokens
            (query_len == context_len, all equal): plain top-left causal
            attention, no mask (SDPA's ``is_causal`` path skips masked blocks).
        mask: True (bool) or 0 (additive float) where a query may see a key;
            (num_seqs, 1, max_query_len * group_size, max_context_len) with
            each query row repeated ``group_size`` times (GQA folding), or
            (num_seqs, 1, 1, max_context_len) for decode groups, or None when
            nothing needs masking (decode with equal contexts, or ``causal``).
        window_masks: for each sliding window that hides a key of this group
            (``window_hides_keys`` of its longest context), ``mask`` of a layer
            with that window, same shape and dtype (never None, and used
            instead of ``causal``); a window absent here hides nothing, so its
            layers take ``mask`` / ``causal`` as they are.
    """

    seq_ids: list[int]
    num_seqs: int
    max_query_len: int
    max_context_len: int
    pages_per_seq: int
    page_index: torch.Tensor
    q_index: torch.Tensor | None
    out_rows: torch.Tensor | None
    token_index: torch.Tensor | None
    causal: bool
    mask: torch.Tensor | None
    window_masks: dict[int, torch.Tensor]


def token_starts(query_lens: Sequence[int]) -> list[int]:
    """Index of each sequence's first new token in the step's token order."""
    starts: list[int] = []
    acc = 0
    for ql in query_lens:
        starts.append(acc)
        acc += ql
    return starts


def build_attention_group(
    layout: StepLayout,
    seq_ids: list[int],
    page_size: int,
    group_size: int,
    device: torch.device | str = "cpu",
    starts: list[int] | None = None,
    mask_dtype: torch.dtype = torch.bool,
    windows: Sequence[int] = (),
) -> AttentionGroup:
    """Index tensors for the padded attention call over ``seq_ids`` (ascending).

    ``group_size`` is num_heads // num_kv_heads: the backend folds the query
    heads sharing one kv head into the query axis, so mask rows repeat.
    ``starts`` is ``token_starts(layout.query_lens)``, passed in when several
    groups are built for one step. ``mask_dtype`` other than bool gives an
    additive mask (0 / -inf) in that dtype: SDPA converts a bool mask on every
    call, which costs more than the attention itself for prefill on CPU.
    ``windows``: the distinct sliding windows of the backend's layers; each
    that hides a key here gets its mask in ``window_masks``.
    """
    qlens = [layout.query_lens[s] for s in seq_ids]
    ctxs = [layout.context_lens[s] for s in seq_ids]
    n, max_q, max_c = len(seq_ids), max(qlens), max(ctxs)
    pages_per_seq = num_pages_for(max_c, page_size)
    page_rows: list[int] = []
    for s, c in zip(seq_ids, ctxs, strict=True):
        used = num_pages_for(c, page_size)
        page_rows += layout.page_tables[s][:used]
        if used < pages_per_seq:
            page_rows += [0] * (pages_per_seq - used)

    dev = torch.device(device)

    def as_index(values: list[int]) -> torch.Tensor:
        return as_device_tensor(values, torch.int64, dev)

    whole_step = n == len(layout.query_lens)
    padded = any(ql != max_q for ql in qlens)
    q_index = out_rows = token_index = None
    if not whole_step or padded:
        if starts is None:
            starts = token_starts(layout.query_lens)
        if max_q == 1:  # decode group: one row per sequence, nothing padded
            q_index = token_index = as_index([starts[s] for s in seq_ids])
        else:
            q_rows: list[int] = []
            real_rows: list[int] = []
            tokens: list[int] = []
            for j, (s, ql) in enumerate(zip(seq_ids, qlens, strict=True)):
                start = starts[s]
                q_rows += range(start, start + ql)
                q_rows += [start + ql - 1] * (max_q - ql)
                real_rows += range(j * max_q, j * max_q + ql)
                tokens += range(start, start + ql)
            q_index = as_index(q_rows)
            out_rows = as_index(real_rows) if padded else None
            token_index = None if whole_step else as_index(tokens)

    # Masks are built on the device from the lengths (copied as small index
    # tensors): a mask reaches max_query_len * group_size * max_context_len
    # elements per sequence, too much to build on the host and copy.
    mask: torch.Tensor | None = None
    window_masks: dict[int, torch.Tensor] = {}
    # A window no context here exceeds changes nothing: those layers share ``mask``.
    biting = [w for w in windows if window_hides_keys(max_c, w)]
    causal = max_q > 1 and all(q == max_q for q in qlens) and all(c == max_q for c in ctxs)
    if max_q == 1:
        padded_keys = any(c != max_c for c in ctxs)
        if padded_keys or biting:
            ctx_t = as_index(ctxs)
            keys = torch.arange(max_c, device=dev)[None, :]
            seen = keys < ctx_t[:, None]  # decode: hide each sequence's padding keys
            if padded_keys:
                mask = seen.view(n, 1, 1, max_c)
            for w in biting:  # and the keys before its window (the query sits at ctx - 1)
                window_masks[w] = (seen & (keys >= (ctx_t - w)[:, None])).view(n, 1, 1, max_c)
    elif not causal or biting:
        ctx_t, qlen_t = as_index(ctxs), as_index(qlens)
        # Row i's position; padded rows clamp to the last real row (finite, dropped).
        rows = torch.minimum(torch.arange(max_q, device=dev)[None, :], (qlen_t - 1)[:, None])
        qpos = ctx_t[:, None] - qlen_t[:, None] + rows  # (n, max_q)

        def fold(allowed: torch.Tensor) -> torch.Tensor:
            """(n, max_q, max_c) -> (n, 1, max_q * group_size, max_c), rows repeated per query head."""
            if group_size > 1:
                allowed = allowed.repeat_interleave(group_size, dim=1)
            return allowed.unsqueeze(1)

        if not causal:  # a causal group's unwindowed layers need no mask at all
            mask = fold(torch.arange(max_c, device=dev)[None, None, :] <= qpos[:, :, None])
        if biting:
            behind = qpos[:, :, None] - torch.arange(max_c, device=dev)[None, None, :]  # p - k
            for w in biting:
                window_masks[w] = fold((behind >= 0) & (behind < w))

    def additive(m: torch.Tensor) -> torch.Tensor:
        return torch.zeros(m.shape, dtype=mask_dtype, device=dev).masked_fill_(~m, float("-inf"))

    if mask_dtype != torch.bool:
        if mask is not None:
            mask = additive(mask)
        window_masks = {w: additive(m) for w, m in window_masks.items()}

    return AttentionGroup(
        seq_ids=list(seq_ids),
        num_seqs=n,
        max_query_len=max_q,
        max_context_len=max_c,
        pages_per_seq=pages_per_seq,
        page_index=as_index(page_rows),
        q_index=q_index,
        out_rows=out_rows,
        token_index=token_index,
        causal=causal,
        mask=mask,
        window_masks=window_masks,
    )


def build_flashinfer_indices(
    layout: StepLayout, page_size: int, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """FlashInfer's ragged-query / paged-KV index arrays for one step, int32.

    ``FlashInferPagedAttention.plan`` (kvcache/attention/flashinfer.py)
    passes these to the wrappers' ``plan()``.

    Keys: ``qo_indptr`` (batch+1,) cumulative query lengths;
    ``paged_kv_indptr`` (batch+1,) cumulative pages used per sequence;
    ``paged_kv_indices`` the used pages of every sequence, concatenated;
    ``paged_kv_last_page_len`` (batch,) tokens in each sequence's last page
    (in 1..page_size). Only the pages the context needs are listed, even if
    the page table holds more.
    """
    qo_indptr = [0]
    kv_indptr = [0]
    indices: list[int] = []
    last_page_len: list[int] = []
    for q, c, pages in zip(layout.query_lens, layout.context_lens, layout.page_tables, strict=True):
        used = num_pages_for(c, page_size)
        qo_indptr.append(qo_indptr[-1] + q)
        kv_indptr.append(kv_indptr[-1] + used)
        indices.extend(pages[:used])
        last_page_len.append(c - (used - 1) * page_size)

    def as_i32(values: list[int]) -> torch.Tensor:
        return as_device_tensor(values, torch.int32, torch.device(device))

    return {
        "qo_indptr": as_i32(qo_indptr),
        "paged_kv_indptr": as_i32(kv_indptr),
        "paged_kv_indices": as_i32(indices),
        "paged_kv_last_page_len": as_i32(last_page_len),
    }
