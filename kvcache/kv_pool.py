"""The KV tensor pool: one k and one v tensor per layer, cut into fixed-size pages.

Layout is NHD per page, ``(num_pages, page_size, num_kv_heads, head_dim)``,
which is also FlashInfer's paged KV layout, so both attention backends
(kvcache/attention/: torch and FlashInfer) use the same tensors. Page ``p`` of every layer belongs to the same
sequence: the page allocator hands out page ids, this module only owns bytes.

With a quantized ``kv_dtype`` (``int8``, ``fp8_e4m3``; see ``kv_dtypes`` and
``kv_quant``) the page tensors hold one byte per element and
``k_scales``/``v_scales`` hold one bfloat16 scale per token and kv head,
``(num_pages, page_size, num_kv_heads)``, beside them.

With ``pad_page=True`` the tensors hold one page more than ``num_pages``: page
``num_pages`` (``pad_page_id``) is a sink for the padding rows of a
static-shape decode step (``AttentionBackend.plan_static_decode``, CUDA
graphs), which must write their k/v and attend somewhere that no sequence
owns. The allocator never hands it out and ``read_pages`` / ``write_pages``
refuse it.

``read_pages`` / ``write_pages`` copy pages' contents out and in as a
``KVPayload`` (``kv_transfer``): prefill/decode disaggregation moves a
prompt's KV between replicas that way.

Also here: how many pages fit in memory (``plan_num_pages``) and the one-line
capacity report printed at start-up.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from kvcache import device_copy
from kvcache.errors import CacheConfigError
from kvcache.kv_dtypes import canonical_kv_dtype, kv_bytes_per_token_head
from kvcache.kv_quant import SCALE_DTYPE, STORAGE_DTYPES, is_quantized
from kvcache.kv_transfer import (
    INT_OF_WIDTH,
    KVPayload,
    KVPayloadMismatchError,
    check_payload,
    dtype_name,
)


def bytes_per_page(
    num_layers: int,
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    kv_dtype: str = "auto",
) -> int:
    """Bytes one page occupies across all layers, k and v together, scales included.

    ``dtype`` is the model dtype (what ``auto`` stores).
    """
    element_size = torch.empty((), dtype=dtype).element_size()
    per_head = kv_bytes_per_token_head(head_dim, canonical_kv_dtype(kv_dtype), element_size)
    return 2 * num_layers * page_size * num_kv_heads * per_head


class KVPool:
    """Per-layer k/v page tensors, zero-initialised.

    Attributes:
        k_caches, v_caches: one tensor per layer, each
            ``(num_pages, page_size, num_kv_heads, head_dim)``, contiguous, in
            ``cache_dtype``.
        k_scales, v_scales: with a quantized ``kv_dtype``, one bfloat16
            tensor per layer, ``(num_pages, page_size, num_kv_heads)``; else None.
        num_pages, page_size, num_layers, num_kv_heads, head_dim, device.
        dtype: the model dtype (what attention computes in and returns).
        kv_dtype: ``auto``, ``int8`` or ``fp8_e4m3`` (canonical names).
        pad_page_id: the padding sink page (``num_pages``) with ``pad_page=True``, else None.
        cache_dtype: what the pages store: ``dtype`` for ``auto``, else int8 / float8_e4m3fn.
        bytes_per_page: bytes of one page over all layers, k and v, scales included.
        total_bytes: ``num_pages * bytes_per_page`` (a pad page is not counted).
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        kv_dtype: str = "auto",
        pad_page: bool = False,
    ) -> None:
        if num_pages < 1:
            raise CacheConfigError("num_kv_pages", f"must be >= 1, got {num_pages}")
        if page_size < 1:
            raise CacheConfigError("page_size", f"must be >= 1, got {page_size}")
        if num_layers < 1 or num_kv_heads < 1 or head_dim < 1:
            raise ValueError(
                f"num_layers, num_kv_heads and head_dim must be >= 1, got "
                f"{num_layers}, {num_kv_heads}, {head_dim}"
            )
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.kv_dtype = canonical_kv_dtype(kv_dtype)
        self.cache_dtype = STORAGE_DTYPES.get(self.kv_dtype, dtype)
        self.pad_page_id: int | None = num_pages if pad_page else None
        shape = (num_pages + int(pad_page), page_size, num_kv_heads, head_dim)
        # Zeroed, not empty: padding slots of a gather read pages nobody wrote,
        # and NaN garbage there would poison attention even under a mask in
        # some kernels (0 * NaN).
        self.k_caches: list[torch.Tensor] = self._zeros(shape, self.cache_dtype)
        self.v_caches: list[torch.Tensor] = self._zeros(shape, self.cache_dtype)
        self.k_scales: list[torch.Tensor] | None = None
        self.v_scales: list[torch.Tensor] | None = None
        if is_quantized(self.kv_dtype):
            self.k_scales = self._zeros(shape[:3], SCALE_DTYPE)
            self.v_scales = self._zeros(shape[:3], SCALE_DTYPE)
        self.bytes_per_page = bytes_per_page(num_layers, page_size, num_kv_heads, head_dim, dtype, self.kv_dtype)
        self.total_bytes = num_pages * self.bytes_per_page

    def _zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
        return [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(self.num_layers)]

    @property
    def is_quantized(self) -> bool:
        """True when pages hold int8 / fp8 values with per-token, per-head scales."""
        return self.k_scales is not None

    @property
    def num_tokens(self) -> int:
        """Token slots in the pool (``num_pages * page_size``)."""
        return self.num_pages * self.page_size

    def read_pages(self, pages: list[int]) -> KVPayload:
        """A CPU copy of ``pages``' contents (every layer, k and v, scales too), in ``pages`` order.

        On CUDA this waits once for the work queued so far (``device_copy.to_host``).
        """
        return self.payload(device_copy.to_host(self.gather_pages(pages)))

    def gather_pages(self, pages: list[int]) -> list[torch.Tensor]:
        """``pages``' contents on the pool's device, copied out of the pool (nothing waits).

        Every layer's k, then every layer's v, then (quantized pools) the k
        and v scales the same way; ``payload`` takes their host copies.
        """
        index = self._page_index(pages)
        caches = [*self.k_caches, *self.v_caches, *(self.k_scales or []), *(self.v_scales or [])]
        return [c.index_select(0, index) for c in caches]

    def payload(self, host: list[torch.Tensor]) -> KVPayload:
        """The ``KVPayload`` of host copies of a ``gather_pages`` result (in its order)."""
        n = self.num_layers
        assert len(host) == (4 if self.is_quantized else 2) * n, (len(host), n)
        k, v = tuple(host[:n]), tuple(host[n : 2 * n])
        k_scales = tuple(host[2 * n : 3 * n]) if self.is_quantized else None
        v_scales = tuple(host[3 * n :]) if self.is_quantized else None
        return KVPayload(
            k=k, v=v, k_scales=k_scales, v_scales=v_scales, kv_dtype=self.kv_dtype, dtype=dtype_name(self.dtype),
        )

    def write_pages(self, pages: list[int], payload: KVPayload) -> None:
        """Overwrite ``pages`` (in order) with ``payload``'s pages, every layer.

        Raises:
            KVPayloadMismatchError: the payload was read from a pool of another
                layout (kv_cache_dtype, model dtype, page size, layers, kv
                heads per rank, head_dim), or holds a different number of
                pages than ``pages`` names, or a page id is out of range.
        """
        check_payload(self, pages, payload)
        index = self._page_index(pages)
        pairs = [(self.k_caches, payload.k), (self.v_caches, payload.v)]
        if self.k_scales is not None and self.v_scales is not None:
            assert payload.k_scales is not None and payload.v_scales is not None  # kv_dtype agreed
            pairs += [(self.k_scales, payload.k_scales), (self.v_scales, payload.v_scales)]
        for caches, values in pairs:
            for cache, value in zip(caches, values, strict=True):
                # Copied as same-width integers: index_copy_ has no float8 kernel on CPU.
                bits = INT_OF_WIDTH[cache.element_size()]
                cache.view(bits).index_copy_(0, index, device_copy.to_device(value, self.device).view(bits))

    def _page_index(self, pages: list[int]) -> torch.Tensor:
        if pages and not 0 <= min(pages) <= max(pages) < self.num_pages:
            raise KVPayloadMismatchError(
                "pages", f"page ids must be in [0, {self.num_pages}), got {min(pages)}..{max(pages)}"
            )
        return device_copy.as_device_tensor(pages, torch.long, self.device)

    def __repr__(self) -> str:
        return (
            f"KVPool(num_layers={self.num_layers}, num_pages={self.num_pages}, "
            f"page_size={self.page_size}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, dtype={self.dtype}, kv_dtype={self.kv_dtype}, device={self.device}, "
            f"total_bytes={self.total_bytes})"
        )


def available_memory_bytes(device: torch.device | str) -> int:
    """Free memory the KV pool could take on ``device``.

    CUDA: free bytes from ``torch.cuda.mem_get_info``. CPU: ``MemAvailable``
    from /proc/meminfo (what the kernel could hand out without swapping),
    falling back to available physical pages from ``os.sysconf``.
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        free, _total = torch.cuda.mem_get_info(dev)
        return int(free)
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the file counts kB
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))


@dataclass(frozen=True, slots=True)
class KVCapacity:
    """What the KV pool will hold; built by ``plan_num_pages``.

    ``max_concurrent_seqs`` is how many sequences of ``max_model_len`` tokens
    fit at once (not capped by ``max_num_seqs``, which is kept for the report).
    """

    num_pages: int
    num_tokens: int
    bytes: int
    max_concurrent_seqs: int
    page_size: int
    max_model_len: int
    max_num_seqs: int
    kv_dtype: str = "auto"  # what the pages store, for the report: a model dtype's name, int8 or fp8_e4m3

    def describe(self) -> str:
        """One line for start-up logging: pages, tokens and bytes in the pool's dtype."""
        stored = self.kv_dtype
        if is_quantized(stored):
            stored += " + bf16 scales per token and head"
        return (
            f"KV cache ({stored}): {self.num_pages} pages x {self.page_size} tokens = "
            f"{self.num_tokens} tokens, {self.bytes / 2**20:.1f} MiB, "
            f"{self.bytes // max(self.num_tokens, 1)} bytes per token; "
            f"{self.max_concurrent_seqs} sequences of max_model_len {self.max_model_len} "
            f"fit at once (max_num_seqs {self.max_num_seqs})"
        )


def plan_num_pages(
    *,
    num_pages: int | None,
    kv_cache_memory_fraction: float,
    available_bytes: int,
    bytes_per_page: int,
    page_size: int,
    max_model_len: int,
    max_num_seqs: int,
    kv_dtype: str = "auto",
) -> KVCapacity:
    """Decide the pool size.

    ``num_pages`` (the ``num_kv_pages`` override) wins when given; otherwise
    ``floor(kv_cache_memory_fraction * available_bytes / bytes_per_page)``.
    The caller picks the fraction (on CPU it should be modest: the pool is
    not the only tenant of host RAM).

    Raises:
        CacheConfigError: ``kv_cache_memory_fraction`` outside (0, 1];
            ``num_kv_pages`` below 1; ``page_size`` below 1; ``max_model_len``
            needing more pages than the pool holds (message has both numbers).
    """
    if not 0.0 < kv_cache_memory_fraction <= 1.0:
        raise CacheConfigError(
            "kv_cache_memory_fraction",
            f"must be in (0, 1], got {kv_cache_memory_fraction}",
        )
    if page_size < 1:
        raise CacheConfigError("page_size", f"must be >= 1, got {page_size}")
    assert bytes_per_page > 0, bytes_per_page
    if num_pages is not None:
        if num_pages < 1:
            raise CacheConfigError("num_kv_pages", f"must be >= 1, got {num_pages}")
        pages = num_pages
        source = f"num_kv_pages={num_pages}"
    else:
        pages = int(kv_cache_memory_fraction * available_bytes) // bytes_per_page
        source = (
            f"kv_cache_memory_fraction {kv_cache_memory_fraction} of "
            f"{available_bytes / 2**20:.1f} MiB available"
        )
    pages_per_seq = math.ceil(max_model_len / page_size)
    if pages_per_seq > pages:
        raise CacheConfigError(
            "max_model_len",
            f"max_model_len {max_model_len} needs {pages_per_seq} pages of {page_size} "
            f"tokens but the KV pool holds only {pages} pages ({pages * page_size} tokens; "
            f"{source}, {bytes_per_page} bytes per page); lower max_model_len or raise "
            f"kv_cache_memory_fraction / num_kv_pages",
        )
    return KVCapacity(
        num_pages=pages,
        num_tokens=pages * page_size,
        bytes=pages * bytes_per_page,
        max_concurrent_seqs=pages // max(pages_per_seq, 1),
        page_size=page_size,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        kv_dtype=kv_dtype,
    )
