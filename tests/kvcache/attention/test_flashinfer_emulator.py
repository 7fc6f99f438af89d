"""The CPU emulator of FlashInfer's wrappers against dense causal attention, and its argument rules."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.kvcache import flashinfer_emulator as fi
from tests.kvcache.attention.test_torch_attention import dense_attention

WORKSPACE = torch.zeros(16, dtype=torch.uint8)


class Case:
    """Requests of (new queries, keys) in random, non-contiguous pages of one NHD cache."""

    def __init__(
        self, reqs: list[tuple[int, int]], *, heads: tuple[int, int], head_dim: int, page_size: int,
        seed: int, dtype: torch.dtype = torch.float32,
    ) -> None:  # fmt: skip
        rng = random.Random(seed)
        torch.manual_seed(seed)
        self.reqs, self.page_size = reqs, page_size
        self.num_heads, self.num_kv_heads = heads
        num_pages = sum(-(-kv // page_size) for _, kv in reqs) + 8
        free = list(range(num_pages))
        rng.shuffle(free)
        shape = (num_pages, page_size, self.num_kv_heads, head_dim)
        self.k, self.v = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
        qo, kv_ptr, indices, last = [0], [0], [], []
        self.pages: list[list[int]] = []
        for q, kv in reqs:
            used = -(-kv // page_size)
            pages = [free.pop() for _ in range(used)]
            self.pages.append(pages)
            qo.append(qo[-1] + q)
            kv_ptr.append(kv_ptr[-1] + used)
            indices += pages
            last.append(kv - (used - 1) * page_size)
        i32 = torch.int32
        self.qo_indptr, self.kv_indptr = torch.tensor(qo, dtype=i32), torch.tensor(kv_ptr, dtype=i32)
        self.indices, self.last = torch.tensor(indices, dtype=i32), torch.tensor(last, dtype=i32)
        self.q = torch.randn(qo[-1], self.num_heads, head_dim).to(dtype)

    def dense(self, scale_k: float = 1.0, scale_v: float = 1.0) -> torch.Tensor:
        """Each request's dense causal attention (float64), its queries last in its keys."""
        out, row = [], 0
        for (q, kv), pages in zip(self.reqs, self.pages, strict=True):
            k = self.k[torch.tensor(pages)].flatten(0, 1)[:kv].double() * scale_k
            v = self.v[torch.tensor(pages)].flatten(0, 1)[:kv].double() * scale_v
            out.append(dense_attention(self.q[row : row + q], k, v, kv - q))
            row += q
        return torch.cat(out)

    def prefill(self, **kw: object) -> fi.BatchPrefillWithPagedKVCacheWrapper:
        w = fi.BatchPrefillWithPagedKVCacheWrapper(WORKSPACE, "NHD")
        w.plan(self.qo_indptr, self.kv_indptr, self.indices, self.last, self.num_heads, self.num_kv_heads,
               self.q.shape[-1], self.page_size, causal=True, q_data_type=self.q.dtype, **kw)  # type: ignore[arg-type]
        return w

    def decode(self, **kw: object) -> fi.BatchDecodeWithPagedKVCacheWrapper:
        w = fi.BatchDecodeWithPagedKVCacheWrapper(WORKSPACE, "NHD")
        w.plan(self.kv_indptr, self.indices, self.last, self.num_heads, self.num_kv_heads,
               self.q.shape[-1], self.page_size, q_data_type=self.q.dtype, **kw)  # type: ignore[arg-type]
        return w


HEADS = [(4, 4), (8, 2), (8, 1), (6, 2)]  # MHA, GQA 4, MQA, GQA 3


@settings(max_examples=40, deadline=None)
@given(
    reqs=st.lists(st.tuples(st.integers(1, 20), st.integers(0, 40)), min_size=1, max_size=5),
    heads=st.sampled_from(HEADS),
    page_size=st.sampled_from([1, 4, 16]),
    seed=st.integers(0, 2**16),
)
def test_prefill_matches_dense_causal_attention(
    reqs: list[tuple[int, int]], heads: tuple[int, int], page_size: int, seed: int
) -> None:
    # (new queries, cached prefix): fresh prompts, chunks and prefix hits (keys > queries).
    case = Case([(q, q + p) for q, p in reqs], heads=heads, head_dim=16, page_size=page_size, seed=seed)
    out = case.prefill().run(case.q, (case.k, case.v))
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), case.dense(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("page_size", [1, 16, 32])
def test_decode_matches_dense_attention_over_all_keys(heads: tuple[int, int], page_size: int) -> None:
    case = Case([(1, kv) for kv in (1, 15, 16, 17, 70)], heads=heads, head_dim=32, page_size=page_size, seed=3)
    out = case.decode().run(case.q, (case.k, case.v))
    torch.testing.assert_close(out.double(), case.dense(), atol=1e-5, rtol=1e-5)
    # A decode is the prefill of one query that sees every key: both wrappers agree.
    torch.testing.assert_close(case.prefill().run(case.q, (case.k, case.v)), out, atol=1e-6, rtol=1e-6)


def test_one_5d_cache_equals_the_tuple_of_two() -> None:
    case = Case([(5, 9), (3, 3)], heads=(8, 2), head_dim=16, page_size=4, seed=1)
    w = case.prefill()
    together = torch.stack([case.k, case.v], dim=1)
    torch.testing.assert_close(w.run(case.q, together), w.run(case.q, (case.k, case.v)), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_kv_reads_values_times_their_scales(dtype: torch.dtype) -> None:
    case = Case([(4, 20), (1, 33)], heads=(8, 2), head_dim=32, page_size=16, seed=5)
    case.q = case.q.to(dtype)
    case.k, case.v = case.k.to(torch.float8_e4m3fn), case.v.to(torch.float8_e4m3fn)
    w = case.prefill(kv_data_type=torch.float8_e4m3fn)
    out = w.run(case.q, (case.k, case.v), k_scale=0.5, v_scale=2.0)
    assert out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), case.dense(0.5, 2.0), atol=tol, rtol=tol)


def test_index_arrays_are_copied_at_plan() -> None:
    case = Case([(3, 10), (2, 2)], heads=(4, 4), head_dim=16, page_size=4, seed=2)
    w = case.prefill()
    before = w.run(case.q, (case.k, case.v))
    case.indices.zero_()
    case.last.fill_(1)
    torch.testing.assert_close(w.run(case.q, (case.k, case.v)), before, atol=0, rtol=0)
    assert (w.num_plans, w.num_runs) == (1, 2)


def test_dtypes_must_be_the_planned_ones() -> None:
    case = Case([(3, 10)], heads=(4, 4), head_dim=16, page_size=4, seed=2)
    w = fi.BatchPrefillWithPagedKVCacheWrapper(WORKSPACE)
    # q_data_type left out: FlashInfer's default is float16.
    w.plan(case.qo_indptr, case.kv_indptr, case.indices, case.last, 4, 4, 16, 4, causal=True)
    with pytest.raises(ValueError, match="q_data_type"):
        w.run(case.q, (case.k, case.v))
    w = case.prefill(kv_data_type=torch.bfloat16)
    with pytest.raises(ValueError, match="kv_data_type"):
        w.run(case.q, (case.k, case.v))


def test_plan_arguments_and_layouts_are_checked() -> None:
    case = Case([(3, 10), (1, 4)], heads=(4, 4), head_dim=16, page_size=4, seed=2)
    w = fi.BatchPrefillWithPagedKVCacheWrapper(WORKSPACE)
    args = (case.qo_indptr, case.kv_indptr, case.indices, case.last, 4, 4, 16, 4)
    with pytest.raises(TypeError):  # optional arguments are keyword-only
        w.plan(*args, None)  # type: ignore[misc]
    with pytest.raises(ValueError, match="int32"):
        w.plan(case.qo_indptr.long(), *args[1:])
    for bad_last in ([0, 4], [3, 5]):
        with pytest.raises(ValueError, match="last_page_len"):
            w.plan(*args[:3], torch.tensor(bad_last, dtype=torch.int32), *args[4:])
    with pytest.raises(ValueError, match="paged_kv_indices"):
        w.plan(args[0], args[1], case.indices[:-1], *args[3:])
    with pytest.raises(ValueError, match="fewer keys"):  # 5 causal queries over 4 keys
        w.plan(torch.tensor([0, 3, 8], dtype=torch.int32), *args[1:], causal=True)
    with pytest.raises(RuntimeError, match="plan"):
        fi.BatchDecodeWithPagedKVCacheWrapper(WORKSPACE).run(case.q, (case.k, case.v))
    with pytest.raises(NotImplementedError, match="prefill_use_cuda_graph"):
        fi.BatchPrefillWithPagedKVCacheWrapper(WORKSPACE, use_cuda_graph=True)
    with pytest.raises(ValueError, match="paged_kv_indptr_buffer should be a torch.Tensor"):
        fi.BatchDecodeWithPagedKVCacheWrapper(WORKSPACE, use_cuda_graph=True)
    with pytest.raises(ValueError, match="batch_size \\+ 1"):
        fi.BatchDecodeWithPagedKVCacheWrapper(WORKSPACE, use_cuda_graph=True, paged_kv_indptr_buffer=torch.zeros(2),
                                              paged_kv_indices_buffer=torch.zeros(4),
                                              paged_kv_last_page_len_buffer=torch.zeros(2))  # fmt: skip
    with pytest.raises(NotImplementedError, match="custom_mask"):
        w.plan(*args, custom_mask=torch.ones(34, dtype=torch.bool))


def test_cuda_graph_decode_equals_plain_decode_and_keeps_its_buffers() -> None:
    """``use_cuda_graph`` decode: same numbers as plain decode, its page table copied into the caller's buffers."""
    case = Case([(1, kv) for kv in (1, 15, 16, 17, 70)], heads=(8, 2), head_dim=32, page_size=16, seed=4)
    i32 = torch.int32
    indptr, indices, last = torch.zeros(6, dtype=i32), torch.full((40,), -1, dtype=i32), torch.zeros(5, dtype=i32)
    w = fi.BatchDecodeWithPagedKVCacheWrapper(WORKSPACE, use_cuda_graph=True, paged_kv_indptr_buffer=indptr,
                                              paged_kv_indices_buffer=indices, paged_kv_last_page_len_buffer=last)  # fmt: skip
    w.plan(case.kv_indptr, case.indices, case.last, 8, 2, 32, 16, q_data_type=case.q.dtype)
    assert torch.equal(indptr, case.kv_indptr) and torch.equal(last, case.last)
    assert torch.equal(indices[: len(case.indices)], case.indices) and (indices[len(case.indices):] == -1).all()
    torch.testing.assert_close(w.run(case.q, (case.k, case.v)), case.decode().run(case.q, (case.k, case.v)),
                               atol=0, rtol=0)  # fmt: skip
    with pytest.raises(ValueError, match="indices should be less than or equal"):
        w.plan(case.kv_indptr, torch.zeros(41, dtype=i32), case.last, 8, 2, 32, 16)
