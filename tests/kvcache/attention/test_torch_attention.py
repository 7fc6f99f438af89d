"""TorchPagedAttention and the index builders against dense float64 attention."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.attention import metadata as meta
from kvcache.attention.backend import StepLayout
from kvcache.attention.torch_paged import TorchPagedAttention
from kvcache.kv_pool import KVPool
from tests.kvcache.workloads import chunked_prefill

HEADS = [(4, 4), (8, 4), (8, 1), (6, 2)]  # (num_heads, num_kv_heads): MHA, GQA, MQA, GQA 3


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """Causal attention in float64; q (n, H, D) at positions start.., k/v (ctx, KVH, D)."""
    group = q.shape[1] // k.shape[1]
    k64 = k.double().repeat_interleave(group, dim=1)
    v64 = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k64) / q.shape[-1] ** 0.5
    pos = torch.arange(start, start + q.shape[0])[:, None]
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v64)


class Sim:
    """Drives the backend step by step, keeping each sequence's true k/v history."""

    def __init__(
        self,
        *,
        heads: tuple[int, int],
        head_dim: int,
        page_size: int,
        num_layers: int,
        seed: int,
        num_tokens: int = 2048,
    ) -> None:
        self.rng = random.Random(seed)
        torch.manual_seed(seed)
        self.num_heads, self.num_kv_heads = heads
        self.head_dim, self.page_size, self.num_layers = head_dim, page_size, num_layers
        self.pool = KVPool(
            num_layers=num_layers,
            num_pages=num_tokens // page_size + 64,
            page_size=page_size,
            num_kv_heads=self.num_kv_heads,
            head_dim=head_dim,
            dtype=torch.float32,
        )
        self.backend = TorchPagedAttention(
            self.pool, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=head_dim
        )
        self.free = list(range(self.pool.num_pages))
        self.rng.shuffle(self.free)  # non-contiguous, unordered page tables
        self.pages: dict[int, list[int]] = {}
        self.hist_k: dict[int, list[torch.Tensor]] = {}
        self.hist_v: dict[int, list[torch.Tensor]] = {}
        self.max_groups = 0

    def length(self, seq: int) -> int:
        return self.hist_k[seq][0].shape[0] if seq in self.hist_k else 0

    def _kv(self, n: int) -> torch.Tensor:
        return torch.randn(n, self.num_kv_heads, self.head_dim)

    def prefill_directly(self, seq: int, n: int) -> None:
        """Put ``n`` tokens of history into the pool by hand (a cached prefix)."""
        self._grow(seq, n)
        for layer in range(self.num_layers):
            k, v = self._kv(n), self._kv(n)
            for p in range(n):
                page, off = self.pages[seq][p // self.page_size], p % self.page_size
                self.pool.k_caches[layer][page, off] = k[p]
                self.pool.v_caches[layer][page, off] = v[p]
            self.hist_k.setdefault(seq, []).append(k)
            self.hist_v.setdefault(seq, []).append(v)

    def _grow(self, seq: int, total: int) -> None:
        pages = self.pages.setdefault(seq, [])
        spare = self.rng.randint(0, 2)  # tables may hold more pages than needed
        while len(pages) * self.page_size < total + spare:
            pages.append(self.free.pop())

    def step(self, work: list[tuple[int, int]]) -> None:
        """One engine step: ``work`` lists (seq, num new tokens); checks every layer."""
        ctxs = [self.length(s) + n for s, n in work]
        for (s, _), c in zip(work, ctxs, strict=True):
            self._grow(s, c)
        layout = StepLayout([n for _, n in work], ctxs, [list(self.pages[s]) for s, _ in work])
        self.backend.plan(layout)
        self.max_groups = max(self.max_groups, len(meta.partition_sequences(layout.query_lens, ctxs)))
        total = sum(n for _, n in work)
        for layer in range(self.num_layers):
            # q as a strided slice, as a fused qkv projection would hand it over.
            qkv = torch.randn(total, self.num_heads + 1, self.head_dim)
            q = qkv[:, : self.num_heads]
            k, v = self._kv(total), self._kv(total)
            out = self.backend.forward(layer, q, k, v)
            assert out.shape == (total, self.num_heads, self.head_dim)
            row = 0
            for s, n in work:
                hk, hv = self.hist_k.setdefault(s, []), self.hist_v.setdefault(s, [])
                if len(hk) <= layer:
                    hk.append(self._kv(0))
                    hv.append(self._kv(0))
                hk[layer] = torch.cat([hk[layer], k[row : row + n]])
                hv[layer] = torch.cat([hv[layer], v[row : row + n]])
                ref = dense_attention(q[row : row + n], hk[layer], hv[layer], hk[layer].shape[0] - n)
                torch.testing.assert_close(out[row : row + n].double(), ref, atol=1e-5, rtol=1e-5)
                row += n
        self.check_pages()

    def check_pages(self) -> None:
        """Every sequence's pages hold exactly its k/v history, in position order."""
        for s, pages in self.pages.items():
            n = self.length(s)
            for layer in range(self.num_layers):
                for cache, hist in ((self.pool.k_caches, self.hist_k), (self.pool.v_caches, self.hist_v)):
                    flat = cache[layer][torch.tensor(pages)].flatten(0, 1)[:n]
                    torch.testing.assert_close(flat, hist[s][layer], atol=0, rtol=0)


@pytest.fixture(params=["default", "split"])
def grouping(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run each test with the real grouping heuristic and with one that splits eagerly."""
    if request.param == "split":
        monkeypatch.setattr(meta, "MIN_WASTE", 0)
        monkeypatch.setattr(meta, "MAX_PADDING_RATIO", 1.0)
    return str(request.param)


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_single_step_random_layouts(data: st.DataObject) -> None:
    for split in (False, True):
        with pytest.MonkeyPatch.context() as mp:
            if split:
                mp.setattr(meta, "MIN_WASTE", 0)
                mp.setattr(meta, "MAX_PADDING_RATIO", 1.0)
            sim = Sim(
                heads=data.draw(st.sampled_from(HEADS)),
                head_dim=data.draw(st.sampled_from([4, 16])),
                page_size=data.draw(st.sampled_from([1, 4, 16])),
                num_layers=data.draw(st.integers(1, 2)),
                seed=data.draw(st.integers(0, 2**16)),
            )
            # (cached prefix, new tokens): decode, chunked prefill, fresh prefill.
            seqs = data.draw(
                st.lists(st.tuples(st.integers(0, 40), st.integers(1, 24)), min_size=1, max_size=6)
            )
            work = []
            for s, (prefix, new) in enumerate(seqs):
                if prefix:
                    sim.prefill_directly(s, prefix)
                work.append((s, new))
            sim.step(work)


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("heads", [(8, 4), (8, 1)])
def test_multi_step_chunked_prefill_then_decode(
    page_size: int, heads: tuple[int, int], grouping: str
) -> None:
    sim = Sim(heads=heads, head_dim=16, page_size=page_size, num_layers=2, seed=page_size)
    prompts = {0: 37, 1: 5, 2: 64, 3: 1}
    # Chunked prefill with a token budget, decodes joining as prompts finish.
    for work in chunked_prefill(prompts, 20):
        sim.step(work)
    for _ in range(4):
        sim.step([(s, 1) for s in prompts])
    # A new sequence prefills while the others decode.
    sim.step([(0, 1), (9, 30), (1, 1)])
    assert sim.length(0) > prompts[0] and sim.length(9) == 30
    assert (sim.max_groups > 1) == (grouping == "split")


def test_decode_only_large_batch(grouping: str) -> None:
    sim = Sim(heads=(8, 4), head_dim=32, page_size=16, num_layers=1, seed=7, num_tokens=16384)
    for s in range(24):
        sim.prefill_directly(s, 1 + sim.rng.randint(0, 120) if s % 3 else 300)
    sim.step([(s, 1) for s in range(24)])
    sim.step([(s, 1) for s in range(24)])


@pytest.mark.parametrize("heads", [(4, 4), (8, 2)])
def test_fresh_equal_prompts_take_causal_path(heads: tuple[int, int]) -> None:
    sim = Sim(heads=heads, head_dim=16, page_size=4, num_layers=2, seed=3)
    layout = StepLayout([21, 21], [21, 21], [[0] * 6, [1] * 6])
    assert meta.build_attention_group(layout, [0, 1], 4, 2).causal
    chunked = StepLayout([21, 21], [21, 25], [[0] * 7, [1] * 7])
    assert not meta.build_attention_group(chunked, [0, 1], 4, 2).causal
    sim.step([(0, 21), (1, 21), (2, 21)])
    sim.step([(0, 1), (1, 1), (2, 1)])


def test_empty_step() -> None:
    sim = Sim(heads=(4, 2), head_dim=8, page_size=4, num_layers=1, seed=0)
    sim.backend.plan(StepLayout([], [], []))
    q, kv = torch.randn(0, 4, 8), torch.randn(0, 2, 8)
    assert sim.backend.forward(0, q, kv, kv).shape == (0, 4, 8)


def test_rejects_mismatched_heads() -> None:
    pool = KVPool(num_layers=1, num_pages=2, page_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    with pytest.raises(ValueError, match="multiple"):
        TorchPagedAttention(pool, num_heads=3, num_kv_heads=2, head_dim=8)
    with pytest.raises(ValueError, match="pool"):
        TorchPagedAttention(pool, num_heads=4, num_kv_heads=4, head_dim=8)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 600), st.integers(0, 3000)), min_size=0, max_size=40),
)
def test_partition_covers_every_sequence_once(seqs: list[tuple[int, int]]) -> None:
    qlens = [q for q, _ in seqs]
    ctxs = [q + extra for q, extra in seqs]
    groups = meta.partition_sequences(qlens, ctxs)
    assert sorted(i for g in groups for i in g) == list(range(len(seqs)))
    assert all(g == sorted(g) and g for g in groups)


def test_partition_keeps_similar_decodes_together_and_splits_long_prefill() -> None:
    ctxs = [180 + (i * 7) % 40 for i in range(64)]
    assert meta.partition_sequences([1] * 64, ctxs) == [list(range(64))]
    groups = meta.partition_sequences([1] * 64 + [1024], ctxs + [1024])
    assert [64] in groups and sum(len(g) for g in groups) == 65


def test_additive_mask_matches_bool_mask() -> None:
    layout = StepLayout([1, 5, 3, 1], [9, 5, 20, 4], [[3, 1, 7], [2, 8], [0, 4, 5, 6, 9], [10]])
    for seq_ids in ([0, 1, 2, 3], [1, 2], [0, 3]):
        bool_g = meta.build_attention_group(layout, seq_ids, 4, 2)
        float_g = meta.build_attention_group(layout, seq_ids, 4, 2, mask_dtype=torch.float32)
        assert bool_g.mask is not None and float_g.mask is not None
        assert bool_g.mask.dtype == torch.bool and float_g.mask.dtype == torch.float32
        assert torch.equal(float_g.mask == 0, bool_g.mask)
        assert torch.isneginf(float_g.mask[~bool_g.mask]).all()
    # Decode with equal contexts needs no mask at all.
    assert meta.build_attention_group(layout, [0], 4, 2).mask is None


@settings(max_examples=60, deadline=None)
@given(
    page_size=st.sampled_from([1, 4, 16]),
    seqs=st.lists(st.tuples(st.integers(0, 50), st.integers(1, 20)), min_size=1, max_size=6),
    seed=st.integers(0, 2**16),
)
def test_flashinfer_indices_match_page_tables(
    page_size: int, seqs: list[tuple[int, int]], seed: int
) -> None:
    rng = random.Random(seed)
    free = list(range(1000))
    rng.shuffle(free)
    qlens = [n for _, n in seqs]
    ctxs = [p + n for p, n in seqs]
    tables = [[free.pop() for _ in range(-(-c // page_size) + rng.randint(0, 2))] for c in ctxs]
    layout = StepLayout(qlens, ctxs, tables)
    idx = meta.build_flashinfer_indices(layout, page_size)
    assert all(t.dtype == torch.int32 for t in idx.values())
    qo, kv_ptr = idx["qo_indptr"].tolist(), idx["paged_kv_indptr"].tolist()
    indices, last = idx["paged_kv_indices"].tolist(), idx["paged_kv_last_page_len"].tolist()
    assert qo[0] == kv_ptr[0] == 0 and len(qo) == len(kv_ptr) == len(seqs) + 1
    slots = meta.build_slot_mapping(layout, page_size).tolist()
    for i, (q, c, table) in enumerate(zip(qlens, ctxs, tables, strict=True)):
        assert qo[i + 1] - qo[i] == q
        pages = indices[kv_ptr[i] : kv_ptr[i + 1]]
        assert 1 <= last[i] <= page_size
        assert (len(pages) - 1) * page_size + last[i] == c
        # Every context position resolves to the same slot via either structure.
        fi_slots = [pages[p // page_size] * page_size + p % page_size for p in range(c)]
        pt_slots = [table[p // page_size] * page_size + p % page_size for p in range(c)]
        assert fi_slots == pt_slots
        assert slots[qo[i] : qo[i + 1]] == fi_slots[c - q :]
