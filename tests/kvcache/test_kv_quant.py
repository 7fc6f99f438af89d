"""Quantized KV pages: round-trip error bounds, the native write and decode, attention vs fp.

Stated tolerances (``kvcache/kv_quant.py`` documents the per-element ones):
per element, int8 ``|x - deq| <= scale/2`` and fp8 e4m3 ``<= |x|/16 +
scale/1024`` (plus a float32 rounding slack); attention over quantized pages,
against the same attention over the exact (float32) pages, within
``ATTENTION_TOLERANCE`` times the largest |v| (measured 0.006 / 0.04 here).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache import cpu_kernels
from kvcache.attention.backend import StepLayout
from kvcache.attention.torch_paged import TorchPagedAttention
from kvcache.kv_pool import KVPool, bytes_per_page
from kvcache.kv_quant import QMAX, dequantize_kv, quantize_kv
from tests.kvcache.native import fail_if_compiler, require_extension

KV_DTYPES = ("int8", "fp8_e4m3")
ATTENTION_TOLERANCE = {"int8": 0.02, "fp8_e4m3": 0.1}


def _bound(x: torch.Tensor, scale: torch.Tensor, kv_dtype: str) -> torch.Tensor:
    s = scale.float().unsqueeze(-1)
    slack = 1e-6 * x.abs() + 1e-30
    if kv_dtype == "int8":
        return s / 2 + slack
    return x.abs() / 16 + s / 1024 + slack


@settings(max_examples=60, deadline=None)
@given(
    kv_dtype=st.sampled_from(KV_DTYPES),
    seed=st.integers(0, 2**31 - 1),
    magnitude=st.sampled_from([1e-6, 1e-2, 1.0, 30.0, 1e4]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_round_trip_within_the_bound(kv_dtype: str, seed: int, magnitude: float, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(7, 3, 64, generator=g) * magnitude).to(dtype)
    x[0, 0] = 0.0  # a zero vector must not divide by zero
    x[1, 1, 5] = -magnitude * 50  # an outlier sets its row's scale
    q, scale = quantize_kv(x, kv_dtype)
    assert q.shape == x.shape and scale.shape == x.shape[:2] and scale.dtype == torch.bfloat16
    back = dequantize_kv(q, scale, torch.float32)
    err = (x.float() - back).abs()
    assert bool((err <= _bound(x.float(), scale, kv_dtype)).all()), float((err - _bound(x.float(), scale, kv_dtype)).max())
    assert bool((back[0, 0] == 0).all())
    assert float(q.float().abs().max()) <= QMAX[kv_dtype]


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_write_stores_the_reference_bytes(kv_dtype: str, dtype: torch.dtype) -> None:
    ext = require_extension()
    pool = KVPool(num_layers=1, num_pages=6, page_size=8, num_kv_heads=2, head_dim=32, dtype=dtype, kv_dtype=kv_dtype)
    qkv = torch.randn(20, 6, 32).to(dtype)  # k and v as strided views, as the model hands them
    k, v = qkv[:, 2:4], qkv[:, 4:]
    slots = torch.randperm(48)[:20]
    flat = [c.view(-1, 2, 32) for c in (pool.k_caches[0], pool.v_caches[0])]
    scales = [c.view(-1, 2) for c in (pool.k_scales[0], pool.v_scales[0])]  # type: ignore[index]
    ext.quantize_write(k, v, slots, *flat, *scales)  # type: ignore[attr-defined]
    for x, values, sc in ((k, flat[0], scales[0]), (v, flat[1], scales[1])):
        want_q, want_s = quantize_kv(x, kv_dtype)
        assert torch.equal(values[slots].view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(sc[slots], want_s)


def test_bytes_per_page_counts_the_scales() -> None:
    fp32 = bytes_per_page(2, 16, 3, 64, torch.float32)
    bf16 = bytes_per_page(2, 16, 3, 64, torch.bfloat16)
    int8 = bytes_per_page(2, 16, 3, 64, torch.float32, "int8")
    assert int8 == bytes_per_page(2, 16, 3, 64, torch.bfloat16, "fp8") == 2 * 2 * 16 * 3 * (64 + 2)
    assert fp32 / int8 > 3.8 and bf16 / int8 > 1.9


def _run_steps(kv_dtype: str, *, kernels: bool, monkeypatch: pytest.MonkeyPatch, seed: int) -> list[torch.Tensor]:
    """A prefill step (two prompts, one chunked), then decode steps; outputs of every step."""
    monkeypatch.setenv(cpu_kernels.ENV_SWITCH, "1" if kernels else "0")
    g = torch.Generator().manual_seed(seed)
    heads, kv_heads, dim, page = 6, 2, 64, 8
    pool = KVPool(num_layers=1, num_pages=40, page_size=page, num_kv_heads=kv_heads, head_dim=dim,
                  dtype=torch.float32, kv_dtype=kv_dtype)
    attn = TorchPagedAttention(pool, num_heads=heads, num_kv_heads=kv_heads, head_dim=dim)
    assert attn.uses_cpu_kernel == (kernels and cpu_kernels.load_extension() is not None)
    if kernels and not attn.uses_cpu_kernel:
        fail_if_compiler("the native kernel")  # else the "native" run below is the torch path again
    tables = [[3, 9, 1, 20, 7, 30], [12, 2, 25, 5, 33, 8]]
    lens = [37, 20]
    outs = []
    steps = [(lens, lens)] + [([1, 1], [lens[0] + i, lens[1] + i]) for i in range(1, 6)]
    for qlens, ctxs in steps:
        n = sum(qlens)
        attn.plan(StepLayout(list(qlens), list(ctxs), tables))
        q = torch.randn(n, heads, dim, generator=g)
        k = torch.randn(n, kv_heads, dim, generator=g) * 2
        v = torch.randn(n, kv_heads, dim, generator=g)
        outs.append(attn.forward(0, q, k, v))
    return outs


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_attention_on_quantized_pages_is_close_to_fp(kv_dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    exact = _run_steps("auto", kernels=False, monkeypatch=monkeypatch, seed=3)
    torch_path = _run_steps(kv_dtype, kernels=False, monkeypatch=monkeypatch, seed=3)
    native = _run_steps(kv_dtype, kernels=True, monkeypatch=monkeypatch, seed=3)
    for e, t, n in zip(exact, torch_path, native, strict=True):
        # v ~ N(0, 1): max |v| over a few hundred draws is about 3.5.
        assert float((t - e).abs().max()) <= ATTENTION_TOLERANCE[kv_dtype] * 3.5
        # Both paths read the same bytes: they agree to float32 rounding.
        assert torch.allclose(n, t, atol=1e-5, rtol=1e-5)
    assert float((torch_path[0] - exact[0]).abs().max()) > 0  # quantization really happened
