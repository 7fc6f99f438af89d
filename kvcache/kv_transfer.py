"""KV page contents in transit: what a prefill replica hands a decode replica.

A ``KVPayload`` is the contents of ``n`` pages of ONE tensor-parallel rank's
pool (rank r's pool holds rank r's share of the KV heads), read by
``KVPool.read_pages`` and written into other page ids of another pool by
``KVPool.write_pages``. Page ids do not travel: the receiver picks its own.

The tensors live on the CPU, contiguous, in the pool's storage dtype, so a
payload moves by pickle (the step channel) or through Ray's object store.
It pickles as numpy arrays viewed as plain integers of the element's width
(numpy has no bfloat16 or float8): such arrays pickle and unpickle faster than
torch tensors, which pickle their storage through ``torch.save``, and Ray hands
numpy arrays out of its object store without a copy (docs/disaggregation.md
gives the measured costs, with the command that printed them). The tensors of
such a payload are then views of read-only shared memory: a payload is only
ever read (frozen; ``write_pages`` copies out of it).

A transfer is one payload per tensor-parallel rank (``RankPayloads``).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from kvcache.errors import CacheConfigError
from kvcache.kv_quant import SCALE_DTYPE

# Integer dtypes of each element width: a bit-exact view of any storage dtype (numpy
# has no bfloat16 or float8; CPU index_copy_ has no float8).
INT_OF_WIDTH: dict[int, torch.dtype] = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class KVPayloadMismatchError(CacheConfigError):
    """A payload cannot go into this pool: the two sides' KV layouts differ.

    ``param`` names the engine setting that must agree on both replicas
    (``kv_cache_dtype``, ``dtype``, ``page_size``, ``model``,
    ``tensor_parallel_size``) or ``pages``; the message gives both values.
    """


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True, slots=True)
class KVPayload:
    """The contents of ``num_pages`` pages of one rank's KV pool, in page order.

    Attributes:
        k, v: one tensor per layer, ``(num_pages, page_size, num_kv_heads,
            head_dim)``, CPU, contiguous, in the pool's storage dtype.
        k_scales, v_scales: with a quantized ``kv_dtype``, one bfloat16
            tensor per layer, ``(num_pages, page_size, num_kv_heads)``; else None.
        kv_dtype: the pool's canonical ``kv_cache_dtype`` (``auto``, ``int8``, ``fp8_e4m3``).
        dtype: the model dtype's name (``bfloat16``): what ``auto`` stores and attention computes in.
    """

    k: tuple[torch.Tensor, ...]
    v: tuple[torch.Tensor, ...]
    k_scales: tuple[torch.Tensor, ...] | None
    v_scales: tuple[torch.Tensor, ...] | None
    kv_dtype: str
    dtype: str

    def __post_init__(self) -> None:
        assert len(self.k) == len(self.v) > 0, (len(self.k), len(self.v))
        assert (self.k_scales is None) == (self.v_scales is None)
        assert self.k_scales is None or len(self.k_scales) == len(self.k)

    @property
    def num_layers(self) -> int:
        return len(self.k)

    @property
    def num_pages(self) -> int:
        return int(self.k[0].shape[0])

    @property
    def page_shape(self) -> tuple[int, int, int]:
        """``(page_size, num_kv_heads, head_dim)`` of every page."""
        _, page_size, heads, head_dim = self.k[0].shape
        return int(page_size), int(heads), int(head_dim)

    @property
    def storage_dtype(self) -> torch.dtype:
        return self.k[0].dtype

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor, scales included."""
        return sum(t.numel() * t.element_size() for t in self._tensors())

    def _tensors(self) -> tuple[torch.Tensor, ...]:
        return self.k + self.v + (self.k_scales or ()) + (self.v_scales or ())

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        # Plain integer arrays pickle (and cross Ray's object store) faster
        # than torch tensors; see the module docstring.
        return _rebuild, (
            _to_arrays(self.k), _to_arrays(self.v), _to_arrays(self.k_scales), _to_arrays(self.v_scales),
            dtype_name(self.storage_dtype), self.kv_dtype, self.dtype,
        )


def _to_arrays(tensors: tuple[torch.Tensor, ...] | None) -> tuple[np.ndarray, ...] | None:
    if tensors is None:
        return None
    return tuple(t.view(INT_OF_WIDTH[t.element_size()]).numpy() for t in tensors)


def _from_arrays(arrays: tuple[np.ndarray, ...] | None, dtype: torch.dtype) -> tuple[torch.Tensor, ...] | None:
    if arrays is None:
        return None
    with warnings.catch_warnings():
        # Arrays from Ray's object store are read-only shared memory; torch
        # warns that writing through the tensor would be undefined. A payload
        # is never written (frozen; write_pages copies out of it).
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return tuple(torch.from_numpy(a).view(dtype) for a in arrays)


def _rebuild(
    k: tuple[np.ndarray, ...],
    v: tuple[np.ndarray, ...],
    k_scales: tuple[np.ndarray, ...] | None,
    v_scales: tuple[np.ndarray, ...] | None,
    storage_dtype: str,
    kv_dtype: str,
    dtype: str,
) -> KVPayload:
    """Unpickle a ``KVPayload`` (see ``KVPayload.__reduce__``)."""
    storage = getattr(torch, storage_dtype)
    kt, vt = _from_arrays(k, storage), _from_arrays(v, storage)
    assert kt is not None and vt is not None
    return KVPayload(
        k=kt, v=vt, k_scales=_from_arrays(k_scales, SCALE_DTYPE), v_scales=_from_arrays(v_scales, SCALE_DTYPE),
        kv_dtype=kv_dtype, dtype=dtype,
    )


class PoolShape(Protocol):
    """What a layout is read from: a pool (``kvcache.kv_pool.KVPool``), named by what it has, since
    ``kv_pool`` imports this module."""

    @property
    def num_layers(self) -> int: ...
    @property
    def page_size(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def kv_dtype(self) -> str: ...
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def cache_dtype(self) -> torch.dtype: ...


# One transfer: every tensor-parallel rank's payload of the same pages, in rank order.
RankPayloads = tuple[KVPayload, ...]


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What every page of a pool holds: what a payload must agree with to be written into it.

    An executor reports its pool's (``KVLayout.of``; every tensor-parallel rank's pool has the
    same shape), so the engine refuses a payload before it gives it a page, naming the field.
    """

    num_layers: int
    page_size: int
    num_kv_heads: int  # per tensor-parallel rank
    head_dim: int
    kv_dtype: str  # canonical kv_cache_dtype
    dtype: str  # the model dtype's name
    storage_dtype: str  # what the pages are stored as (``kv_dtype``'s, or ``dtype`` for ``auto``)

    @classmethod
    def of(cls, pool: PoolShape) -> KVLayout:
        return cls(pool.num_layers, pool.page_size, pool.num_kv_heads, pool.head_dim, pool.kv_dtype,
                   dtype_name(pool.dtype), dtype_name(pool.cache_dtype))


def check_layout(layout: KVLayout, payload: KVPayload) -> None:
    """Raise ``KVPayloadMismatchError`` naming the first field in which ``payload`` differs from ``layout``.

    ``param`` is the engine setting both replicas must share; the message names the field and both values.
    """
    if payload.kv_dtype != layout.kv_dtype:
        raise KVPayloadMismatchError(
            "kv_cache_dtype",
            f"the KV pages were stored as {payload.kv_dtype!r} but this pool stores {layout.kv_dtype!r}: "
            f"both replicas need the same kv_cache_dtype",
        )
    if payload.dtype != layout.dtype:
        raise KVPayloadMismatchError(
            "dtype", f"the KV pages come from a {payload.dtype} model, this pool holds {layout.dtype}: "
            f"both replicas need the same dtype",
        )
    if dtype_name(payload.storage_dtype) != layout.storage_dtype:
        raise KVPayloadMismatchError(
            "dtype", f"the KV pages are stored as {dtype_name(payload.storage_dtype)}, "
            f"this pool as {layout.storage_dtype}",
        )
    page_size, heads, head_dim = payload.page_shape
    if page_size != layout.page_size:
        raise KVPayloadMismatchError(
            "page_size", f"the KV pages hold {page_size} tokens each, this pool's {layout.page_size}: "
            f"both replicas need the same page_size",
        )
    if payload.num_layers != layout.num_layers:
        raise KVPayloadMismatchError(
            "model", f"the KV pages have {payload.num_layers} layers (num_layers), this pool "
            f"{layout.num_layers}: both replicas need the same model",
        )
    if head_dim != layout.head_dim:
        raise KVPayloadMismatchError(
            "model", f"the KV pages have head_dim {head_dim}, this pool {layout.head_dim}: "
            f"both replicas need the same model",
        )
    if heads != layout.num_kv_heads:
        raise KVPayloadMismatchError(
            "tensor_parallel_size", f"the KV pages hold {heads} kv heads per rank (num_kv_heads), this pool "
            f"{layout.num_kv_heads}: both replicas need the same model and tensor_parallel_size",
        )


def check_payload(pool: PoolShape, pages: list[int], payload: KVPayload) -> None:
    """Raise ``KVPayloadMismatchError`` naming the first way ``payload`` does not fit ``pool`` at ``pages``.

    Page ids themselves are range-checked by the pool.
    """
    check_layout(KVLayout.of(pool), payload)
    if len(set(pages)) != len(pages):
        raise KVPayloadMismatchError("pages", f"page ids must be distinct, got {pages}")
    if payload.num_pages != len(pages):
        raise KVPayloadMismatchError(
            "pages", f"the payload holds {payload.num_pages} pages but {len(pages)} page ids were given"
        )
