"""KV page export/import between pools: exact round trips, pickling, and mismatches refused by name."""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import pytest
import torch

from kvcache.kv_pool import KVPool
from kvcache.kv_quant import quantize_kv
from kvcache.kv_transfer import KVPayload, KVPayloadMismatchError

SHAPE: dict[str, Any] = {"num_layers": 3, "page_size": 4, "num_kv_heads": 2, "head_dim": 8}


def _pool(num_pages: int = 12, dtype: torch.dtype = torch.float32, kv_dtype: str = "auto", **over: Any) -> KVPool:
    return KVPool(num_pages=num_pages, dtype=dtype, kv_dtype=kv_dtype, **{**SHAPE, **over})


def _fill(pool: KVPool, seed: int) -> None:
    """Random contents in every page of every layer (quantized pools: real quantized values and scales)."""
    gen = torch.Generator().manual_seed(seed)
    for layer in range(pool.num_layers):
        for caches, scales in ((pool.k_caches, pool.k_scales), (pool.v_caches, pool.v_scales)):
            x = torch.randn(caches[layer].shape, generator=gen)
            if scales is None:
                caches[layer].copy_(x.to(pool.cache_dtype))
            else:
                values, scale = quantize_kv(x, pool.kv_dtype)
                caches[layer].copy_(values)
                scales[layer].copy_(scale)


def _tensors(pool: KVPool) -> list[list[torch.Tensor]]:
    return [pool.k_caches, pool.v_caches, pool.k_scales or [], pool.v_scales or []]


def _assert_pages_equal(a: KVPool, a_pages: list[int], b: KVPool, b_pages: list[int]) -> None:
    for a_list, b_list in zip(_tensors(a), _tensors(b), strict=True):
        for x, y in zip(a_list, b_list, strict=True):
            # Bitwise: compare as integers (NaN-free anyway, but fp8 has no == on every build).
            bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.element_size()]
            assert torch.equal(x[a_pages].view(bits), y[b_pages].view(bits))


CASES = {
    "float32": (torch.float32, "auto"),
    "bfloat16": (torch.bfloat16, "auto"),
    "int8": (torch.bfloat16, "int8"),
    "fp8_e4m3": (torch.float32, "fp8_e4m3"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_round_trip_between_pools_is_exact(case: str) -> None:
    dtype, kv_dtype = CASES[case]
    src, dst = _pool(dtype=dtype, kv_dtype=kv_dtype), _pool(num_pages=20, dtype=dtype, kv_dtype=kv_dtype)
    _fill(src, seed=1)
    _fill(dst, seed=2)
    src_pages, dst_pages = [5, 0, 7], [19, 3, 11]
    untouched = [p for p in range(dst.num_pages) if p not in dst_pages]
    before = [[t[untouched].clone() for t in ts] for ts in _tensors(dst)]

    payload = src.read_pages(src_pages)
    assert payload.num_pages == 3 and payload.num_layers == 3
    assert payload.kv_dtype == src.kv_dtype and payload.storage_dtype == src.cache_dtype
    assert (payload.k_scales is None) == (kv_dtype == "auto")
    for t in (*payload.k, *payload.v):
        assert t.device.type == "cpu" and t.is_contiguous() and t.shape == (3, 4, 2, 8)
    expected_bytes = 3 * src.bytes_per_page
    assert payload.nbytes == expected_bytes

    dst.write_pages(dst_pages, pickle.loads(pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)))
    _assert_pages_equal(src, src_pages, dst, dst_pages)
    # Only the named pages changed.
    for ts, olds in zip(_tensors(dst), before, strict=True):
        for t, old in zip(ts, olds, strict=True):
            assert torch.equal(t[untouched], old)


def test_read_copies_so_later_writes_to_the_pool_do_not_change_the_payload() -> None:
    pool = _pool()
    _fill(pool, seed=3)
    payload = pool.read_pages([1, 2])
    snapshot = payload.k[0].clone()
    pool.k_caches[0].zero_()
    assert torch.equal(payload.k[0], snapshot)


def test_payload_pickles_as_plain_arrays_and_keeps_bits() -> None:
    pool = _pool(dtype=torch.bfloat16, kv_dtype="int8")
    _fill(pool, seed=4)
    payload = pool.read_pages([0, 1, 2, 3])
    _, args = payload.__reduce__()
    for group in args[:4]:  # k, v, k_scales, v_scales
        assert isinstance(group, tuple) and all(isinstance(a, np.ndarray) for a in group)
    back = pickle.loads(pickle.dumps(payload))
    assert isinstance(back, KVPayload)
    assert back.kv_dtype == "int8" and back.dtype == "bfloat16" and back.nbytes == payload.nbytes
    assert back.k_scales is not None and back.k_scales[0].dtype == torch.bfloat16
    for x, y in zip(payload._tensors(), back._tensors(), strict=True):
        assert x.dtype == y.dtype and torch.equal(x, y)


def test_read_inside_inference_mode_pickles() -> None:
    pool = _pool(dtype=torch.bfloat16)
    with torch.inference_mode():
        payload = pool.read_pages([0])
    assert pickle.loads(pickle.dumps(payload)).num_pages == 1


def test_empty_page_list() -> None:
    pool = _pool()
    payload = pool.read_pages([])
    assert payload.num_pages == 0 and payload.nbytes == 0
    pool.write_pages([], payload)


MISMATCHES: dict[str, tuple[dict[str, Any], str, str]] = {
    # (destination pool overrides, param, words the message must hold)
    "int8_into_auto": ({"dtype": torch.bfloat16, "kv_dtype": "auto"}, "kv_cache_dtype", "'int8'"),
    "int8_into_fp8": ({"dtype": torch.bfloat16, "kv_dtype": "fp8_e4m3"}, "kv_cache_dtype", "'fp8_e4m3'"),
    "model_dtype": ({"dtype": torch.float32, "kv_dtype": "int8"}, "dtype", "bfloat16"),
    "page_size": ({"dtype": torch.bfloat16, "kv_dtype": "int8", "page_size": 8}, "page_size", "4 tokens"),
    "layers": ({"dtype": torch.bfloat16, "kv_dtype": "int8", "num_layers": 2}, "model", "3 layers"),
    "head_dim": ({"dtype": torch.bfloat16, "kv_dtype": "int8", "head_dim": 16}, "model", "head_dim 8"),
    "kv_heads": ({"dtype": torch.bfloat16, "kv_dtype": "int8", "num_kv_heads": 1}, "tensor_parallel_size", "2 kv heads"),
}


@pytest.mark.parametrize("case", list(MISMATCHES))
def test_mismatched_payload_is_refused_by_name(case: str) -> None:
    over, param, words = MISMATCHES[case]
    payload = _pool(dtype=torch.bfloat16, kv_dtype="int8").read_pages([0, 1])
    dst = _pool(**over)
    before = [t.clone() for ts in _tensors(dst) for t in ts]
    with pytest.raises(KVPayloadMismatchError) as info:
        dst.write_pages([2, 3], payload)
    assert info.value.param == param
    assert words in str(info.value)
    assert all(torch.equal(t, old) for t, old in zip([t for ts in _tensors(dst) for t in ts], before, strict=True))


@pytest.mark.parametrize(
    ("pages", "words"),
    [([1], "holds 2 pages but 1 page ids"), ([3, 3], "distinct"), ([0, 12], "in [0, 12)"), ([-1, 2], "in [0, 12)")],
)
def test_bad_page_ids_are_refused(pages: list[int], words: str) -> None:
    pool = _pool()
    payload = pool.read_pages([0, 1])
    with pytest.raises(KVPayloadMismatchError, match=words.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")) as info:
        pool.write_pages(pages, payload)
    assert info.value.param == "pages"
