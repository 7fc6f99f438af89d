"""FlashInfer paged attention over the ``KVPool`` pages (the CUDA backend).

Two FlashInfer wrappers share one zeroed workspace (``WORKSPACE_BYTES``): a
``BatchPrefillWithPagedKVCacheWrapper`` for steps where any query is longer
than one token (prefill, chunked prefill, prefix hits, mixed steps; causal,
which FlashInfer aligns bottom-right: query ``t`` of ``q`` new tokens over
``c`` keys sees keys ``<= c - q + t``, exactly the pool's positions) and a
``BatchDecodeWithPagedKVCacheWrapper`` for decode-only steps, on tensor cores
when ``TENSOR_CORE_GROUP_SIZE`` or more query heads share a kv head.

``KVPool`` pages are FlashInfer's NHD layout as they are, ``(num_pages,
page_size, num_kv_heads, head_dim)`` per layer, handed over as the ``(k, v)``
tuple: nothing is copied or converted. ``plan`` runs once per step: the
int32 ``indptr`` / ``indices`` / ``last_page_len`` arrays and the slot
mapping are built on the host (``metadata``), pinned on CUDA, and copied
with ``non_blocking``; FlashInfer's ``plan`` reads its host copies, so no
step input waits for the device. ``forward`` writes the step's k/v at their
slots (as ``TorchPagedAttention`` does) and runs the planned wrapper.

Static-shape decode (CUDA graphs; ``AttentionBackend.plan_static_decode``):
one more decode wrapper per batch size, built with ``use_cuda_graph=True``
over slices of one set of device buffers (``indptr``, ``indices``,
``last_page_len``) and one static slot mapping. FlashInfer's ``plan`` of
such a wrapper copies the step's arrays into those buffers, and its ``run``
reads them from there, so a captured ``forward`` serves every later plan
of the same size. Padding rows are one-token sequences on the pool's pad
page (``KVPool.pad_page_id``): they write there and attend to that slot only.

Sliding windows (``sliding_windows``; the rule is in ``backend``):
FlashInfer fixes ``window_left`` (``w - 1``; -1 for none) when a wrapper is
planned, so every distinct window of the layers gets its own prefill and
decode wrapper (and its own static decode wrapper per batch size), each
planned every step over the same index arrays, and a layer runs its
window's. They all share the one workspace: it holds a run's split-k
partials, and the runs of one step are queued on one stream one after the
other, as vLLM's and SGLang's per-window wrappers share theirs; each
wrapper keeps its plan in its own int workspace. Static wrappers of one
batch size share that size's index buffers: every plan writes them the same
arrays. The softmax scale (``scale``, Gemma 3's ``query_pre_attn_scalar **
-0.5`` for one) reaches every plan as ``sm_scale``.

Every optional ``plan`` argument is passed by keyword: FlashInfer 0.6.0
inserted ``o_data_type`` among the positional ones.

Quantized pages: FlashInfer reads fp8 KV (``kv_data_type``) with one scale
per tensor (``k_scale``/``v_scale`` floats), not the pool's scale per token
and head. So this backend writes fp8 pages with the fixed ``FP8_KV_SCALE``
(vLLM's default without calibration: values stored as they are, clamped to
e4m3's range) and records that scale for each token it writes, which keeps
the pool self-describing for every other reader (the torch backend, KV
transfer). Invariant: every page FlashInfer reads was written with
``FP8_KV_SCALE``; pages imported from a pool written by the torch backend
(its scales vary per token) would be misread. int8 pages are refused:
FlashInfer has no int8 KV path.

The ``flashinfer`` module is passed in (``FlashInferKernels``): the product
passes ``load_flashinfer()``, tests pass their CPU emulator.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Sequence
from typing import Protocol

import torch

from kvcache.attention.backend import AttentionBackend, StepLayout
from kvcache.attention.metadata import (
    build_flashinfer_indices,
    build_slot_mapping,
    check_layout,
    check_sliding_windows,
    num_pages_for,
)
from kvcache.errors import CacheConfigError
from kvcache.kv_pool import KVPool
from kvcache.kv_quant import QMAX

# FlashInfer's recommended workspace: split-k partial results of either wrapper.
WORKSPACE_BYTES = 128 * 2**20
# Decode on tensor cores pays off once this many query heads share a kv head.
TENSOR_CORE_GROUP_SIZE = 4
# The one scale of every fp8 value this backend writes (see the module docstring).
FP8_KV_SCALE = 1.0
FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)  # what FlashInfer's kernels compute in


class PrefillWrapper(Protocol):
    """What the backend uses of ``flashinfer.BatchPrefillWithPagedKVCacheWrapper``."""

    def plan(
        self, qo_indptr: torch.Tensor, paged_kv_indptr: torch.Tensor, paged_kv_indices: torch.Tensor,
        paged_kv_last_page_len: torch.Tensor, num_qo_heads: int, num_kv_heads: int, head_dim_qk: int,
        page_size: int, /, *, causal: bool, pos_encoding_mode: str, window_left: int, sm_scale: float,
        q_data_type: torch.dtype, kv_data_type: torch.dtype, o_data_type: torch.dtype, non_blocking: bool,
    ) -> None: ...  # fmt: skip

    def run(
        self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, torch.Tensor], /, *,
        k_scale: float | None = None, v_scale: float | None = None,
    ) -> torch.Tensor: ...  # fmt: skip


class DecodeWrapper(Protocol):
    """What the backend uses of ``flashinfer.BatchDecodeWithPagedKVCacheWrapper``."""

    def plan(
        self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor,
        num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int, /, *,
        pos_encoding_mode: str, window_left: int, sm_scale: float, q_data_type: torch.dtype,
        kv_data_type: torch.dtype, o_data_type: torch.dtype, non_blocking: bool,
    ) -> None: ...  # fmt: skip

    def run(
        self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, torch.Tensor], /, *,
        k_scale: float | None = None, v_scale: float | None = None,
    ) -> torch.Tensor: ...  # fmt: skip


class PrefillWrapperClass(Protocol):
    def __call__(self, float_workspace_buffer: torch.Tensor, /, *, kv_layout: str) -> PrefillWrapper: ...


class DecodeWrapperClass(Protocol):
    def __call__(
        self, float_workspace_buffer: torch.Tensor, /, *, kv_layout: str, use_tensor_cores: bool,
        use_cuda_graph: bool = False, paged_kv_indptr_buffer: torch.Tensor | None = None,
        paged_kv_indices_buffer: torch.Tensor | None = None,
        paged_kv_last_page_len_buffer: torch.Tensor | None = None,
    ) -> DecodeWrapper: ...  # fmt: skip


class FlashInferKernels(Protocol):
    """The two wrapper classes of the ``flashinfer`` module (or of a module emulating it)."""

    @property
    def BatchPrefillWithPagedKVCacheWrapper(self) -> PrefillWrapperClass: ...

    @property
    def BatchDecodeWithPagedKVCacheWrapper(self) -> DecodeWrapperClass: ...


def flashinfer_installed() -> bool:
    """Whether the ``flashinfer`` package can be imported (found without importing it)."""
    return importlib.util.find_spec("flashinfer") is not None


def load_flashinfer() -> FlashInferKernels:
    """The installed ``flashinfer`` module.

    Raises:
        CacheConfigError: naming ``attention_backend`` and the ``cuda`` extra,
            when flashinfer is not installed.
    """
    try:
        # Imported here, not at the top: flashinfer is the optional `cuda`
        # extra, absent from CPU installs, which must import this module.
        import flashinfer
    except ImportError as e:
        raise CacheConfigError("attention_backend", _NOT_INSTALLED) from e
    return flashinfer


_NOT_INSTALLED = (
    "flashinfer is not installed: install flotilla's `cuda` extra (pip install 'flotilla[cuda]'), "
    "or use attention_backend='torch' or 'auto'"
)


def check_flashinfer_settings(
    *, device: torch.device, dtype: torch.dtype, kv_dtype: str, kernels_given: bool
) -> None:
    """Refuse, by the setting's name, what attention_backend='flashinfer' cannot run.

    ``kernels_given``: the caller passes its own kernels (the tests' CPU
    emulator), which run on any device and dtype; only the KV format is then
    checked.

    Raises:
        CacheConfigError: ``kv_cache_dtype`` int8; ``attention_backend`` off
            CUDA or without the flashinfer package; ``dtype`` other than
            float16 / bfloat16.
    """
    if kv_dtype == "int8":
        raise CacheConfigError(
            "kv_cache_dtype",
            "int8 pages cannot be read by FlashInfer (it has no int8 KV path): use kv_cache_dtype "
            "'fp8_e4m3' or 'auto' with attention_backend='flashinfer', or attention_backend='torch'",
        )
    if kernels_given:
        return
    if device.type != "cuda":
        raise CacheConfigError(
            "attention_backend",
            f"flashinfer runs on CUDA only, and the device is {device.type}: "
            f"use attention_backend='torch' or 'auto'",
        )
    if dtype not in FLASHINFER_DTYPES:
        raise CacheConfigError(
            "dtype", f"FlashInfer computes in float16 or bfloat16, not {str(dtype).removeprefix('torch.')}"
        )
    if not flashinfer_installed():
        raise CacheConfigError("attention_backend", _NOT_INSTALLED)


class FlashInferPagedAttention(AttentionBackend):
    """Causal paged attention over a ``KVPool`` with FlashInfer's wrappers; one per engine.

    ``kernels`` is the ``flashinfer`` module or an emulation of it. ``scale``
    defaults to ``1 / sqrt(head_dim)``; ``workspace_bytes`` to FlashInfer's
    recommended ``WORKSPACE_BYTES``. ``sliding_windows``: one window (or None)
    per pool layer, None for none anywhere (``metadata.check_sliding_windows``).

    Wrappers, keyed by ``window_left``: ``prefill_wrappers``,
    ``decode_wrappers`` and, once ``enable_static_decode`` ran,
    ``static_decode_wrappers`` (then by batch size). ``prefill``, ``decode``
    and ``static_decode`` are layer 0's (every layer's, without windows).
    """

    def __init__(
        self,
        pool: KVPool,
        kernels: FlashInferKernels,
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float | None = None,
        workspace_bytes: int = WORKSPACE_BYTES,
        sliding_windows: Sequence[int | None] | None = None,
    ) -> None:
        if num_kv_heads != pool.num_kv_heads or head_dim != pool.head_dim:
            raise ValueError(
                f"backend num_kv_heads={num_kv_heads}, head_dim={head_dim} do not match the "
                f"pool's {pool.num_kv_heads}, {pool.head_dim}"
            )
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
        check_flashinfer_settings(device=pool.device, dtype=pool.dtype, kv_dtype=pool.kv_dtype, kernels_given=True)
        self.sliding_windows = check_sliding_windows(sliding_windows, pool.num_layers)
        # FlashInfer's spelling of each layer's window, and the distinct ones (one set of wrappers each).
        self.window_lefts = tuple(-1 if w is None else w - 1 for w in self.sliding_windows)
        self._distinct_window_lefts = sorted(set(self.window_lefts))
        self.pool = pool
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group_size = num_heads // num_kv_heads
        self.scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
        # FlashInfer asks for a zeroed workspace before its first use.
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=pool.device)
        self._kernels = kernels
        self.prefill_wrappers: dict[int, PrefillWrapper] = {
            wl: kernels.BatchPrefillWithPagedKVCacheWrapper(self.workspace, kv_layout="NHD")
            for wl in self._distinct_window_lefts
        }
        self.decode_wrappers: dict[int, DecodeWrapper] = {
            wl: kernels.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, kv_layout="NHD", use_tensor_cores=self.group_size >= TENSOR_CORE_GROUP_SIZE
            )
            for wl in self._distinct_window_lefts
        }
        self.prefill = self.prefill_wrappers[self.window_lefts[0]]
        self.decode = self.decode_wrappers[self.window_lefts[0]]
        # Static-shape decode, set up by enable_static_decode: one wrapper per window and batch size.
        self.static_decode_wrappers: dict[int, dict[int, DecodeWrapper]] = {}
        self.static_decode: dict[int, DecodeWrapper] = {}
        self._static_slots: torch.Tensor | None = None
        self._max_pages_per_seq = 0
        self._caches = list(zip(pool.k_caches, pool.v_caches, strict=True))
        # Flat (num_pages * page_size, kv_heads, head_dim) views for the
        # slot-indexed write; they share storage with the pool's tensors.
        self._flat_k = [c.view(-1, num_kv_heads, head_dim) for c in pool.k_caches]
        self._flat_v = [c.view(-1, num_kv_heads, head_dim) for c in pool.v_caches]
        self._flat_ks = [c.view(-1, num_kv_heads) for c in pool.k_scales or []]
        self._flat_vs = [c.view(-1, num_kv_heads) for c in pool.v_scales or []]
        self._kv_scale = FP8_KV_SCALE if pool.is_quantized else None
        self._pinned = pool.device.type == "cuda"
        self._num_tokens = 0
        self._slots: torch.Tensor | None = None
        # The step's planned wrapper of each window_left (empty until plan, and for an empty step).
        self._planned: dict[int, PrefillWrapper | DecodeWrapper] = {}

    supports_static_decode = True

    def _host(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (built on the host) in pinned memory on CUDA, so copies of it need not wait."""
        return t.pin_memory() if self._pinned else t

    def plan(self, layout: StepLayout) -> None:
        """Plan the step's wrapper from host index arrays; copy the slot mapping to the device."""
        page_size = self.pool.page_size
        check_layout(layout, page_size)
        self._num_tokens = sum(layout.query_lens)
        self._planned = {}
        if self._num_tokens == 0:  # nothing to attend: FlashInfer is not asked to plan a batch of 0
            self._slots = None
            return
        idx = {name: self._host(t) for name, t in build_flashinfer_indices(layout, page_size).items()}
        self._slots = self._host(build_slot_mapping(layout, page_size)).to(self.pool.device, non_blocking=True)
        if max(layout.query_lens) == 1:
            self._plan_decode(self.decode_wrappers, idx)
            return
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        dtype, kv_dtype = self.pool.dtype, self.pool.cache_dtype
        for wl, wrapper in self.prefill_wrappers.items():
            wrapper.plan(
                idx["qo_indptr"], idx["paged_kv_indptr"], idx["paged_kv_indices"], idx["paged_kv_last_page_len"],
                h, kvh, d, page_size, causal=True, pos_encoding_mode="NONE", window_left=wl, sm_scale=self.scale,
                q_data_type=dtype, kv_data_type=kv_dtype, o_data_type=dtype, non_blocking=True,
            )  # fmt: skip
        self._planned = dict(self.prefill_wrappers)

    def _plan_decode(self, wrappers: dict[int, DecodeWrapper], idx: dict[str, torch.Tensor]) -> None:
        """Plan ``wrappers`` (the dynamic or one size's static decode wrappers, by window_left) from host index arrays."""
        dtype = self.pool.dtype
        for wl, wrapper in wrappers.items():
            wrapper.plan(
                idx["paged_kv_indptr"], idx["paged_kv_indices"], idx["paged_kv_last_page_len"],
                self.num_heads, self.num_kv_heads, self.head_dim, self.pool.page_size, pos_encoding_mode="NONE",
                window_left=wl, sm_scale=self.scale, q_data_type=dtype, kv_data_type=self.pool.cache_dtype,
                o_data_type=dtype, non_blocking=True,
            )  # fmt: skip
        self._planned = dict(wrappers)

    def enable_static_decode(self, batch_sizes: Sequence[int], max_pages_per_seq: int) -> None:
        """One ``use_cuda_graph`` decode wrapper per window and batch size, over slices of shared buffers.

        The buffers can be shared because one step runs at a time: a plan for
        one size overwrites what another size's graph would read, and a
        graph is replayed only right after its own size's plan (whose
        wrappers, one per window, all write the same arrays).
        """
        if self.pool.pad_page_id is None:
            raise ValueError("static-shape decode needs a pool with a pad page (KVPool(pad_page=True))")
        if not batch_sizes or min(batch_sizes) < 1 or max_pages_per_seq < 1:
            raise ValueError(f"batch sizes {list(batch_sizes)} and max_pages_per_seq {max_pages_per_seq} must be >= 1")
        largest, dev = max(batch_sizes), self.pool.device
        indptr = torch.zeros(largest + 1, dtype=torch.int32, device=dev)
        indices = torch.zeros(largest * max_pages_per_seq, dtype=torch.int32, device=dev)
        last_page_len = torch.zeros(largest, dtype=torch.int32, device=dev)
        self._static_slots = torch.zeros(largest, dtype=torch.int64, device=dev)
        self._max_pages_per_seq = max_pages_per_seq
        self.static_decode_wrappers = {
            wl: {
                size: self._kernels.BatchDecodeWithPagedKVCacheWrapper(
                    self.workspace, kv_layout="NHD", use_tensor_cores=self.group_size >= TENSOR_CORE_GROUP_SIZE,
                    use_cuda_graph=True, paged_kv_indptr_buffer=indptr[: size + 1],
                    paged_kv_indices_buffer=indices[: size * max_pages_per_seq],
                    paged_kv_last_page_len_buffer=last_page_len[:size],
                )  # fmt: skip
                for size in sorted(set(batch_sizes))
            }
            for wl in self._distinct_window_lefts
        }
        self.static_decode = self.static_decode_wrappers[self.window_lefts[0]]

    def plan_static_decode(self, batch_size: int, layout: StepLayout) -> None:
        """Pad ``layout`` to ``batch_size`` one-token rows on the pad page and plan that size's wrappers."""
        wrappers = {wl: by_size[batch_size] for wl, by_size in self.static_decode_wrappers.items()
                    if batch_size in by_size}  # fmt: skip
        assert wrappers and self._static_slots is not None, (
            f"no static decode of batch size {batch_size}: enabled for {sorted(self.static_decode)}"
        )
        n, pad_page, page_size = len(layout.query_lens), self.pool.pad_page_id, self.pool.page_size
        assert pad_page is not None and n <= batch_size and all(q == 1 for q in layout.query_lens), (n, batch_size)
        assert all(num_pages_for(c, page_size) <= self._max_pages_per_seq for c in layout.context_lens), (
            f"a context needs more than max_pages_per_seq={self._max_pages_per_seq} pages"
        )
        pad = batch_size - n
        padded = StepLayout(
            [*layout.query_lens, *[1] * pad], [*layout.context_lens, *[1] * pad],
            [*layout.page_tables, *[[pad_page]] * pad],
        )  # fmt: skip
        check_layout(padded, page_size)
        idx = {name: self._host(t) for name, t in build_flashinfer_indices(padded, page_size).items()}
        self._slots = self._static_slots[:batch_size]
        self._slots.copy_(self._host(build_slot_mapping(padded, page_size)), non_blocking=True)
        self._num_tokens = batch_size
        self._plan_decode(wrappers, idx)

    def forward(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Write k/v into ``layer_id``'s pages, return its (windowed) causal attention (tokens, heads, dim).

        ``q``, ``k`` and ``v`` must be in the pool's model dtype.
        """
        assert q.shape[0] == self._num_tokens == k.shape[0] == v.shape[0], (
            q.shape,
            k.shape,
            self._num_tokens,
        )
        if self._num_tokens == 0:
            return q.new_empty(0, self.num_heads, self.head_dim)
        assert self._planned and self._slots is not None, "plan() must run before forward()"
        self._write(layer_id, k, v, self._slots)
        if q.stride(-1) != 1:  # the kernels take strided tokens and heads, not a strided head_dim
            q = q.contiguous()
        wrapper = self._planned[self.window_lefts[layer_id]]
        return wrapper.run(q, self._caches[layer_id], k_scale=self._kv_scale, v_scale=self._kv_scale)

    def _write(self, layer_id: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Store the step's k and v at their slots (as fp8 with ``FP8_KV_SCALE`` in an fp8 pool)."""
        if not self.pool.is_quantized:
            self._flat_k[layer_id].index_copy_(0, slots, k)
            self._flat_v[layer_id].index_copy_(0, slots, v)
            return
        qmax = QMAX["fp8_e4m3"]
        for x, values, scales in ((k, self._flat_k, self._flat_ks), (v, self._flat_v, self._flat_vs)):
            stored = (x.float() * (1.0 / FP8_KV_SCALE)).clamp_(-qmax, qmax).to(torch.float8_e4m3fn)
            # As bytes: torch has no index_copy_ for float8 on the CPU.
            values[layer_id].view(torch.uint8).index_copy_(0, slots, stored.view(torch.uint8))
            scales[layer_id].index_fill_(0, slots, FP8_KV_SCALE)
