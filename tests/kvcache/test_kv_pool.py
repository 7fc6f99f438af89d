"""KVPool shapes and bytes; plan_num_pages sizing and its errors."""

from __future__ import annotations

import pytest
import torch

from kvcache.errors import CacheConfigError
from kvcache.kv_pool import (
    KVCapacity,
    KVPool,
    available_memory_bytes,
    bytes_per_page,
    plan_num_pages,
)


def test_pool_shapes_and_bytes() -> None:
    pool = KVPool(
        num_layers=3, num_pages=10, page_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float16
    )
    assert len(pool.k_caches) == len(pool.v_caches) == 3
    for cache in (*pool.k_caches, *pool.v_caches):
        assert cache.shape == (10, 4, 2, 8)
        assert cache.dtype == torch.float16
        assert cache.is_contiguous()
        assert cache.device.type == "cpu"
        assert not cache.any()
    # Distinct storage per layer and for k vs v.
    ptrs = {c.data_ptr() for c in (*pool.k_caches, *pool.v_caches)}
    assert len(ptrs) == 6
    assert pool.bytes_per_page == 2 * 3 * 4 * 2 * 8 * 2
    assert pool.total_bytes == 10 * pool.bytes_per_page
    actual = sum(c.numel() * c.element_size() for c in (*pool.k_caches, *pool.v_caches))
    assert actual == pool.total_bytes
    assert pool.num_tokens == 40
    assert "num_pages=10" in repr(pool)


def test_bytes_per_page_function() -> None:
    assert bytes_per_page(2, 16, 4, 32, torch.float32) == 2 * 2 * 16 * 4 * 32 * 4
    assert bytes_per_page(1, 1, 1, 1, torch.bfloat16) == 4


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"num_pages": 0}, "num_kv_pages"),
        ({"page_size": 0}, "page_size"),
    ],
)
def test_pool_rejects_bad_sizes(kwargs: dict[str, int], param: str) -> None:
    args = {"num_layers": 1, "num_pages": 4, "page_size": 4, "num_kv_heads": 1, "head_dim": 4}
    args.update(kwargs)
    with pytest.raises(CacheConfigError) as info:
        KVPool(
            num_layers=args["num_layers"],
            num_pages=args["num_pages"],
            page_size=args["page_size"],
            num_kv_heads=args["num_kv_heads"],
            head_dim=args["head_dim"],
            dtype=torch.float32,
        )
    assert info.value.param == param


def test_available_memory_cpu_positive() -> None:
    assert available_memory_bytes("cpu") > 0
    assert available_memory_bytes(torch.device("cpu")) > 0


def _plan(**overrides: object) -> KVCapacity:
    args: dict[str, object] = {
        "num_pages": None,
        "kv_cache_memory_fraction": 0.5,
        "available_bytes": 1_000_000,
        "bytes_per_page": 1000,
        "page_size": 16,
        "max_model_len": 160,
        "max_num_seqs": 8,
    }
    args.update(overrides)
    return plan_num_pages(**args)  # type: ignore[arg-type]


def test_plan_from_fraction_floors() -> None:
    cap = _plan(available_bytes=1_000_999, kv_cache_memory_fraction=0.5)
    assert cap.num_pages == 500  # floor(500_499.5 / 1000)
    assert cap.num_tokens == 500 * 16
    assert cap.bytes == 500 * 1000
    assert cap.max_concurrent_seqs == 50  # 160 tokens = 10 pages each
    line = cap.describe()
    assert "\n" not in line
    for piece in ("500 pages", "16 tokens", "8000 tokens", "50 sequences", "160", "8"):
        assert piece in line


def test_plan_override_wins() -> None:
    cap = _plan(num_pages=12, available_bytes=0)
    assert cap.num_pages == 12
    assert cap.max_concurrent_seqs == 1
    assert cap.bytes == 12_000


def test_plan_fraction_one_allowed() -> None:
    assert _plan(kv_cache_memory_fraction=1.0).num_pages == 1000


def test_plan_max_concurrent_rounds_partial_pages_up() -> None:
    # 161 tokens need 11 pages of 16.
    assert _plan(num_pages=22, max_model_len=161).max_concurrent_seqs == 2


@pytest.mark.parametrize("fraction", [0.0, -0.1, 1.01, 2.0])
def test_plan_rejects_fraction(fraction: float) -> None:
    with pytest.raises(CacheConfigError) as info:
        _plan(kv_cache_memory_fraction=fraction)
    assert info.value.param == "kv_cache_memory_fraction"
    assert str(fraction) in str(info.value)


def test_plan_rejects_max_model_len_beyond_pool_fraction() -> None:
    with pytest.raises(CacheConfigError) as info:
        _plan(max_model_len=8192, available_bytes=200_000, kv_cache_memory_fraction=0.5)
    err = info.value
    assert err.param == "max_model_len"
    msg = str(err)
    for piece in ("8192", "512 pages", "16 tokens", "only 100 pages", "1600 tokens"):
        assert piece in msg
    assert "kv_cache_memory_fraction" in msg and "num_kv_pages" in msg


def test_plan_rejects_max_model_len_beyond_pool_override() -> None:
    with pytest.raises(CacheConfigError) as info:
        _plan(num_pages=9, max_model_len=160)
    assert info.value.param == "max_model_len"
    assert "10 pages" in str(info.value) and "only 9 pages" in str(info.value)
    # Exactly enough is fine.
    assert _plan(num_pages=10, max_model_len=160).num_pages == 10


def test_plan_rejects_bad_override_and_page_size() -> None:
    with pytest.raises(CacheConfigError) as info:
        _plan(num_pages=0)
    assert info.value.param == "num_kv_pages"
    with pytest.raises(CacheConfigError) as info:
        _plan(page_size=0)
    assert info.value.param == "page_size"


def test_plan_with_real_pool_sizes() -> None:
    per_page = bytes_per_page(4, 16, 4, 32, torch.float32)
    available = available_memory_bytes("cpu")
    cap = plan_num_pages(
        num_pages=None,
        kv_cache_memory_fraction=0.1,
        available_bytes=available,
        bytes_per_page=per_page,
        page_size=16,
        max_model_len=256,
        max_num_seqs=4,
    )
    assert cap.num_pages * per_page <= 0.1 * available < (cap.num_pages + 1) * per_page
    assert cap.num_pages >= 16
