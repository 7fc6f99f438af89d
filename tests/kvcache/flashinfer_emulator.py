"""A CPU emulator of FlashInfer's two paged-KV attention wrappers, for tests only.

Pass this module where the ``flashinfer`` module is expected
(``FlashInferPagedAttention(pool, flashinfer_emulator, ...)``,
``EngineConfig(attention_kernels=flashinfer_emulator)``): nothing in the
product falls back to it.

``BatchPrefillWithPagedKVCacheWrapper`` and ``BatchDecodeWithPagedKVCacheWrapper``
keep FlashInfer 0.6's constructor, ``plan`` and ``run`` signatures and
argument semantics, written in torch from FlashInfer's documentation (the
KV-cache layout tutorial and the wrappers' docstrings):

- Pages in CSR form: request ``i`` owns pages ``indices[indptr[i]:indptr[i+1]]``
  and holds ``page_size * (num_pages - 1) + last_page_len[i]`` keys, with
  ``1 <= last_page_len[i] <= page_size``.
- NHD caches: a tuple ``(k, v)`` of ``(num_pages, page_size, num_kv_heads, head_dim)``
  or one ``(num_pages, 2, page_size, num_kv_heads, head_dim)`` tensor.
- ``causal`` is aligned bottom-right: query ``t`` of a request with ``qo_len``
  queries over ``kv_len`` keys sees keys ``j <= kv_len - qo_len + t``. A decode
  query sees all of its request's keys.
- ``window_left`` (``plan``'s; -1 = none) is a sliding window on the left, with
  or without ``causal``: query ``t``, at position ``kv_len - qo_len + t``, sees
  keys ``j >= kv_len - qo_len + t - window_left`` (the decode query, at
  ``kv_len - 1``, the last ``window_left + 1``). ``run``'s ``window_left``, when
  given, must be the planned one.
- GQA: query head ``h`` reads kv head ``h // (num_qo_heads // num_kv_heads)``.
- Logits are ``q . k * sm_scale * k_scale`` (``sm_scale`` defaults to
  ``1 / sqrt(head_dim)``), the output is multiplied by ``v_scale``; computed in
  float32 and returned in ``o_data_type`` (default: ``q_data_type``).
- ``q_data_type`` defaults to float16; ``run`` raises ValueError when ``q`` or
  the k cache is not in the dtype ``plan`` named, as FlashInfer does.
- ``plan`` takes its own copy of the index arrays (FlashInfer copies them to
  the device there): changing them after ``plan`` changes nothing.
- CUDA-graph mode of the decode wrapper (``use_cuda_graph=True``): the
  constructor needs ``paged_kv_indptr_buffer`` / ``paged_kv_indices_buffer``
  / ``paged_kv_last_page_len_buffer`` tensors, the batch size is fixed to
  ``len(paged_kv_last_page_len_buffer)`` (the indptr buffer one longer),
  ``plan`` raises ValueError for another batch size or more indices than the
  indices buffer holds and copies the arrays into those buffers, and ``run``
  reads the page table from the buffers as they are then (as a replayed
  graph reads device memory), not from ``plan``'s arguments.

Deliberately stricter: optional ``plan`` arguments are keyword-only (FlashInfer
0.6.0 inserted ``o_data_type`` among the positional ones, so callers must
not rely on positions); index arrays must be int32 (FlashInfer's docs: int64
indexes wrongly) and consistent; features flotilla does not use (custom
masks, in-kernel RoPE, soft caps, the prefill wrapper's CUDA graphs,
HND, ``return_lse``, fp8 queries) raise NotImplementedError rather than
being approximated.
Deliberately wider: float32 is accepted (FlashInfer's kernels take float16 /
bfloat16, and fp8 KV), so index logic is checked at float32 precision.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class _Plan:
    qo_indptr: list[int]
    kv_indptr: list[int]
    indices: torch.Tensor  # int64, on the host
    last_page_len: list[int]
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    causal: bool
    sm_scale: float
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    o_dtype: torch.dtype
    window_left: int


def _dtype(d: str | torch.dtype | None, default: torch.dtype) -> torch.dtype:
    if d is None:
        return default
    return getattr(torch, d) if isinstance(d, str) else d


def _ints(name: str, t: torch.Tensor) -> list[int]:
    if not isinstance(t, torch.Tensor) or t.dim() != 1:
        raise ValueError(f"{name} must be a 1-D tensor")
    if t.dtype != torch.int32:
        raise ValueError(f"{name} must be int32, got {t.dtype}")
    values: list[int] = t.tolist()
    return values


def _unsupported(**features: object) -> None:
    for name, value in features.items():
        if value:
            raise NotImplementedError(f"the emulator does not implement {name}")


def _make_plan(
    qo_indptr: list[int], kv_indptr_t: torch.Tensor, indices_t: torch.Tensor, last_t: torch.Tensor,
    num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int, *, causal: bool,
    pos_encoding_mode: str, window_left: int, logits_soft_cap: float | None, sm_scale: float | None,
    q_data_type: str | torch.dtype, kv_data_type: str | torch.dtype | None,
    o_data_type: str | torch.dtype | None,
) -> _Plan:  # fmt: skip
    kv_indptr = _ints("paged_kv_indptr", kv_indptr_t)
    indices = _ints("paged_kv_indices", indices_t)
    last = _ints("paged_kv_last_page_len", last_t)
    _unsupported(pos_encoding_mode=pos_encoding_mode != "NONE", logits_soft_cap=bool(logits_soft_cap))
    if window_left < -1:
        raise ValueError(f"window_left must be -1 (no window) or >= 0, got {window_left}")
    batch = len(last)
    if len(qo_indptr) != batch + 1 or len(kv_indptr) != batch + 1:
        raise ValueError(f"indptr arrays need batch_size + 1 = {batch + 1} entries")
    for name, ptr in (("qo_indptr", qo_indptr), ("paged_kv_indptr", kv_indptr)):
        if ptr[0] != 0 or any(b < a for a, b in zip(ptr, ptr[1:], strict=False)):
            raise ValueError(f"{name} must start at 0 and never decrease: {ptr}")
    if len(indices) != kv_indptr[-1]:
        raise ValueError(f"paged_kv_indices has {len(indices)} entries, paged_kv_indptr[-1] is {kv_indptr[-1]}")
    if num_qo_heads % num_kv_heads:
        raise ValueError(f"num_qo_heads {num_qo_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    for i in range(batch):
        num_pages, qo_len = kv_indptr[i + 1] - kv_indptr[i], qo_indptr[i + 1] - qo_indptr[i]
        if num_pages < 1 or not 1 <= last[i] <= page_size:
            raise ValueError(f"request {i}: {num_pages} pages, last_page_len {last[i]} (must be in 1..{page_size})")
        if causal and qo_len > page_size * (num_pages - 1) + last[i]:
            raise ValueError(f"request {i}: {qo_len} queries over fewer keys under causal")
    q_dtype = _dtype(q_data_type, torch.float16)
    return _Plan(
        qo_indptr=qo_indptr, kv_indptr=kv_indptr, indices=torch.tensor(indices, dtype=torch.int64),
        last_page_len=last, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        page_size=page_size, causal=causal,
        sm_scale=sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim), q_dtype=q_dtype,
        kv_dtype=_dtype(kv_data_type, q_dtype), o_dtype=_dtype(o_data_type, q_dtype), window_left=window_left,
    )  # fmt: skip


def _attend(
    plan: _Plan | None, q: torch.Tensor, paged_kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    args: tuple[object, ...], *, q_scale: float | None, k_scale: float | None, v_scale: float | None,
    out: torch.Tensor | None, lse: torch.Tensor | None, return_lse: bool, window_left: int | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:  # fmt: skip
    if plan is None:
        raise RuntimeError("plan() must run before run()")
    _unsupported(custom_args=bool(args), q_scale=q_scale is not None, lse=lse is not None,
                 return_lse=return_lse, sinks=sinks is not None)
    if window_left is not None and window_left != plan.window_left:
        raise ValueError(f"window_left {window_left} differs from plan's {plan.window_left}")
    k_cache, v_cache = paged_kv_cache if isinstance(paged_kv_cache, tuple) else paged_kv_cache.unbind(1)
    if q.dtype != plan.q_dtype:
        raise ValueError(f"The dtype of q {q.dtype} does not match the q_data_type {plan.q_dtype} specified in plan function.")
    if k_cache.dtype != plan.kv_dtype or v_cache.dtype != plan.kv_dtype:
        raise ValueError(f"The dtype of k {k_cache.dtype} does not match the kv_data_type {plan.kv_dtype} specified in plan function.")
    h, kvh, d = plan.num_qo_heads, plan.num_kv_heads, plan.head_dim
    if q.shape != (plan.qo_indptr[-1], h, d) or q.stride(-1) != 1:
        raise ValueError(f"q must be ({plan.qo_indptr[-1]}, {h}, {d}) with a contiguous last dim, got {tuple(q.shape)}")
    expected = (k_cache.shape[0], plan.page_size, kvh, d)
    if k_cache.shape != expected or v_cache.shape != expected:
        raise ValueError(f"NHD caches must be {expected}, got {tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    if plan.indices.numel() and not 0 <= int(plan.indices.min()) <= int(plan.indices.max()) < k_cache.shape[0]:
        raise ValueError("a page index is outside the cache")
    result = q.new_empty(q.shape, dtype=plan.o_dtype) if out is None else out
    if result.shape != q.shape or result.dtype != plan.o_dtype:
        raise ValueError(f"out must be {tuple(q.shape)} in {plan.o_dtype}")
    group = h // kvh
    for i in range(len(plan.last_page_len)):
        pages = plan.indices[plan.kv_indptr[i] : plan.kv_indptr[i + 1]].to(k_cache.device)
        kv_len = plan.page_size * (pages.numel() - 1) + plan.last_page_len[i]
        q0, q1 = plan.qo_indptr[i], plan.qo_indptr[i + 1]
        if q1 == q0:
            continue

        def gather(cache: torch.Tensor, scale: float | None, pages: torch.Tensor = pages, n: int = kv_len) -> torch.Tensor:
            # Through bytes: torch has no index_select for float8 on the CPU.
            rows = cache.view(torch.uint8).index_select(0, pages).view(cache.dtype).reshape(-1, kvh, d)[:n]
            return rows.float().repeat_interleave(group, dim=1) * (1.0 if scale is None else scale)

        k, v = gather(k_cache, k_scale), gather(v_cache, v_scale)
        scores = torch.einsum("qhd,khd->hqk", q[q0:q1].float(), k) * plan.sm_scale
        qpos = torch.arange(q1 - q0, device=q.device)[:, None] + (kv_len - (q1 - q0))
        keys = torch.arange(kv_len, device=q.device)[None, :]
        if plan.causal:
            scores = scores.masked_fill(keys > qpos, float("-inf"))
        if plan.window_left >= 0:
            scores = scores.masked_fill(keys < qpos - plan.window_left, float("-inf"))
        result[q0:q1] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v).to(plan.o_dtype)
    return result


def _check_workspace(buffer: torch.Tensor, kv_layout: str, backend: str) -> None:
    if not isinstance(buffer, torch.Tensor):
        raise TypeError("float_workspace_buffer must be a tensor")
    if kv_layout not in ("NHD", "HND"):
        raise ValueError(f"Invalid kv_layout {kv_layout}")
    _unsupported(HND=kv_layout == "HND", backend=backend != "auto")


class BatchPrefillWithPagedKVCacheWrapper:
    """Prefill / append attention of ragged queries over paged keys (see the module docstring)."""

    def __init__(
        self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
        qo_indptr_buf: torch.Tensor | None = None, paged_kv_indptr_buf: torch.Tensor | None = None,
        paged_kv_indices_buf: torch.Tensor | None = None, paged_kv_last_page_len_buf: torch.Tensor | None = None,
        custom_mask_buf: torch.Tensor | None = None, mask_indptr_buf: torch.Tensor | None = None,
        backend: str = "auto",
    ) -> None:  # fmt: skip
        _check_workspace(float_workspace_buffer, kv_layout, backend)
        _unsupported(prefill_use_cuda_graph=use_cuda_graph)
        self.float_workspace_buffer = float_workspace_buffer
        self.num_plans = 0
        self.num_runs = 0
        self._plan: _Plan | None = None

    def plan(
        self, qo_indptr: torch.Tensor, paged_kv_indptr: torch.Tensor, paged_kv_indices: torch.Tensor,
        paged_kv_last_page_len: torch.Tensor, num_qo_heads: int, num_kv_heads: int, head_dim_qk: int,
        page_size: int, *, head_dim_vo: int | None = None, custom_mask: torch.Tensor | None = None,
        packed_custom_mask: torch.Tensor | None = None, causal: bool = False, pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False, sm_scale: float | None = None, window_left: int = -1,
        logits_soft_cap: float | None = None, rope_scale: float | None = None, rope_theta: float | None = None,
        q_data_type: str | torch.dtype = "float16", kv_data_type: str | torch.dtype | None = None,
        o_data_type: str | torch.dtype | None = None, non_blocking: bool = True,
    ) -> None:  # fmt: skip
        _unsupported(custom_mask=custom_mask is not None or packed_custom_mask is not None,
                     head_dim_vo=head_dim_vo not in (None, head_dim_qk), use_fp16_qk_reduction=use_fp16_qk_reduction)
        self._plan = _make_plan(
            _ints("qo_indptr", qo_indptr), paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
            num_qo_heads, num_kv_heads, head_dim_qk, page_size, causal=causal,
            pos_encoding_mode=pos_encoding_mode, window_left=window_left, logits_soft_cap=logits_soft_cap,
            sm_scale=sm_scale, q_data_type=q_data_type, kv_data_type=kv_data_type, o_data_type=o_data_type,
        )  # fmt: skip
        self.num_plans += 1

    def run(
        self, q: torch.Tensor, paged_kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor], *args: object,
        q_scale: float | None = None, k_scale: float | None = None, v_scale: float | None = None,
        out: torch.Tensor | None = None, lse: torch.Tensor | None = None, return_lse: bool = False,
        enable_pdl: bool | None = None, window_left: int | None = None, sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        self.num_runs += 1
        return _attend(self._plan, q, paged_kv_cache, args, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale,
                       out=out, lse=lse, return_lse=return_lse, window_left=window_left, sinks=sinks)


class BatchDecodeWithPagedKVCacheWrapper:
    """Decode attention, one query per request over its paged keys (see the module docstring)."""

    def __init__(
        self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
        use_tensor_cores: bool = False, paged_kv_indptr_buffer: torch.Tensor | None = None,
        paged_kv_indices_buffer: torch.Tensor | None = None,
        paged_kv_last_page_len_buffer: torch.Tensor | None = None, backend: str = "auto",
    ) -> None:  # fmt: skip
        _check_workspace(float_workspace_buffer, kv_layout, backend)
        self.float_workspace_buffer = float_workspace_buffer
        self.use_tensor_cores = use_tensor_cores  # a kernel choice: same numbers either way
        self.num_plans = 0
        self.num_runs = 0
        self._plan: _Plan | None = None
        self.is_cuda_graph_enabled = use_cuda_graph
        self._buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        if use_cuda_graph:
            buffers = (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)
            for name, buf in zip(("paged_kv_indptr_buffer", "paged_kv_indices_buffer",
                                  "paged_kv_last_page_len_buffer"), buffers, strict=True):  # fmt: skip
                if not isinstance(buf, torch.Tensor):
                    raise ValueError(f"{name} should be a torch.Tensor in cudagraph mode")
            indptr_buf, indices_buf, last_buf = buffers
            assert indptr_buf is not None and indices_buf is not None and last_buf is not None
            if len(indptr_buf) != len(last_buf) + 1:
                raise ValueError("The size of paged_kv_indptr_buffer should be batch_size + 1")
            self._buffers = (indptr_buf, indices_buf, last_buf)

    def plan(
        self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor, num_qo_heads: int,
        num_kv_heads: int, head_dim: int, page_size: int, *, pos_encoding_mode: str = "NONE",
        window_left: int = -1, logits_soft_cap: float | None = None,
        q_data_type: str | torch.dtype | None = "float16", kv_data_type: str | torch.dtype | None = None,
        o_data_type: str | torch.dtype | None = None, data_type: str | torch.dtype | None = None,
        sm_scale: float | None = None, rope_scale: float | None = None, rope_theta: float | None = None,
        non_blocking: bool = True,
    ) -> None:  # fmt: skip
        if data_type is not None:  # the deprecated spelling of both dtypes
            q_data_type = q_data_type if q_data_type is not None else data_type
            kv_data_type = kv_data_type if kv_data_type is not None else data_type
        batch = len(last_page_len)
        if self._buffers is not None:
            indptr_buf, indices_buf, last_buf = self._buffers
            if batch != len(last_buf):
                raise ValueError(
                    f"The batch size should be fixed in cudagraph mode, the runtime batch size {batch} "
                    f" mismatches the batch size set during initialization {len(last_buf)}"
                )
            if len(indices) > len(indices_buf):
                raise ValueError("The size of indices should be less than or equal to the allocated buffer")
        self._plan = _make_plan(
            list(range(batch + 1)), indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
            page_size, causal=False, pos_encoding_mode=pos_encoding_mode, window_left=window_left,
            logits_soft_cap=logits_soft_cap, sm_scale=sm_scale, q_data_type=q_data_type or "float16",
            kv_data_type=kv_data_type, o_data_type=o_data_type,
        )  # fmt: skip
        if self._buffers is not None:
            indptr_buf.copy_(indptr)
            indices_buf[: len(indices)].copy_(indices)
            last_buf.copy_(last_page_len)
        self.num_plans += 1

    def _graph_plan(self) -> _Plan | None:
        """The plan with its page table read from the graph buffers, as a replay would see them."""
        if self._buffers is None or self._plan is None:
            return self._plan
        indptr_buf, indices_buf, last_buf = self._buffers
        kv_indptr = _ints("paged_kv_indptr_buffer", indptr_buf.cpu())
        indices = indices_buf[: kv_indptr[-1]].cpu().to(torch.int64)
        return replace(self._plan, kv_indptr=kv_indptr, indices=indices,
                       last_page_len=_ints("paged_kv_last_page_len_buffer", last_buf.cpu()))  # fmt: skip

    def run(
        self, q: torch.Tensor, paged_kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor], *args: object,
        q_scale: float | None = None, k_scale: float | None = None, v_scale: float | None = None,
        out: torch.Tensor | None = None, lse: torch.Tensor | None = None, return_lse: bool = False,
        enable_pdl: bool | None = None, window_left: int | None = None, sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        self.num_runs += 1
        return _attend(self._graph_plan(), q, paged_kv_cache, args, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale,
                       out=out, lse=lse, return_lse=return_lse, window_left=window_left, sinks=sinks)
