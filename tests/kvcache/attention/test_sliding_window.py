"""Per-layer sliding windows in every attention backend, against dense float64 attention.

The rule (``kvcache.attention.backend``): a query at position ``p`` of a layer
with window ``w`` sees the keys ``k`` with ``p - w < k <= p``; None is plain
causal. ``windowed_dense`` below states it again, independently of the
backends' helpers, and is the oracle of every backend: TorchPagedAttention
with the native decode kernel and without it (``FLOTILLA_CPU_KERNELS=0``),
and FlashInferPagedAttention on the CPU emulator, dynamic and static-shape
decode. Layers mix a short window that is no multiple of the page size,
no window, a longer one and one longer than every context; steps mix
chunked prefill over a cached prefix, fresh prompts (alone and as equal-length
groups), decode-only and mixed steps. Quantized pools are checked against
attention over their stored pages, dequantized.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from types import ModuleType
from typing import Any, Literal

import pytest
import torch

from kvcache import cpu_kernels
from kvcache.attention import metadata as meta
from kvcache.attention.backend import AttentionBackend, StepLayout
from kvcache.attention.flashinfer import (
    WORKSPACE_BYTES,
    FlashInferKernels,
    FlashInferPagedAttention,
    flashinfer_installed,
    load_flashinfer,
)
from kvcache.attention.torch_paged import TorchPagedAttention
from kvcache.kv_pool import KVPool
from kvcache.kv_quant import dequantize_kv
from tests.kvcache import flashinfer_emulator
from tests.kvcache.native import require_extension
from tests.kvcache.test_cpu_kernels import random_problem
from tests.kvcache.workloads import chunked_prefill

HEAD_DIM = 32
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
# Layer 0: shorter than most contexts and no multiple of 16 or 32; layer 1:
# none; layer 2: longer, still shorter than the longest contexts; layer 3:
# longer than every context of the workload (must change nothing).
WINDOWS: tuple[int | None, ...] = (13, None, 37, 10_000)
Kind = Literal["kernel", "torch", "flashinfer"]


def windowed_dense(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, window: int | None, scale: float
) -> torch.Tensor:
    """float64 attention of q (n, H, D) at positions start.. over k/v (ctx, KVH, D) under ``window``."""
    group = q.shape[1] // k.shape[1]
    k64 = k.double().repeat_interleave(group, dim=1)
    v64 = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k64) * scale
    pos = torch.arange(start, start + q.shape[0])[:, None]
    keys = torch.arange(k.shape[0])[None, :]
    hidden = keys > pos
    if window is not None:
        hidden |= pos - keys >= window
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores.masked_fill(hidden, float("-inf")), -1), v64)


class Driver:
    """One backend over its own pool, driven step by step and checked on every layer.

    ``outputs`` keeps every forward's real rows, so drivers of equal seeds
    can be compared bit for bit.
    """

    def __init__(
        self, kind: Kind, *, heads: tuple[int, int], page_size: int, dtype: torch.dtype, seed: int,
        windows: Sequence[int | None] | None, kv_dtype: str = "auto", scale: float | None = None,
        static_sizes: tuple[int, ...] = (), num_layers: int | None = None, pass_windows: bool = True,
        kernels: FlashInferKernels | ModuleType = flashinfer_emulator, device: str = "cpu", head_dim: int = HEAD_DIM,
    ) -> None:  # fmt: skip
        self.rng = random.Random(seed)
        torch.manual_seed(seed)
        self.heads, self.page_size, self.dtype, self.device, self.head_dim = heads, page_size, dtype, device, head_dim
        self.windows = tuple(windows) if windows is not None else (None,) * (num_layers or len(WINDOWS))
        self.pool = KVPool(num_layers=len(self.windows), num_pages=4096 // page_size, page_size=page_size,
                           num_kv_heads=heads[1], head_dim=head_dim, dtype=dtype, device=device,
                           kv_dtype=kv_dtype, pad_page=bool(static_sizes))  # fmt: skip
        self.scale = scale if scale is not None else head_dim**-0.5
        self.backend: AttentionBackend
        # pass_windows False: the backend is built without the keyword, as before windows existed.
        window_arg = {"sliding_windows": windows} if pass_windows else {}
        if kind == "flashinfer":
            self.backend = FlashInferPagedAttention(
                self.pool, kernels, num_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim,
                scale=scale, workspace_bytes=1 << 12 if device == "cpu" else WORKSPACE_BYTES, **window_arg,
            )  # fmt: skip
        else:
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv(cpu_kernels.ENV_SWITCH, "1" if kind == "kernel" else "0")
                if kind == "kernel":
                    require_extension()  # fails where a compiler exists but the build failed
                torch_backend = TorchPagedAttention(self.pool, num_heads=heads[0], num_kv_heads=heads[1],
                                                    head_dim=head_dim, scale=scale, **window_arg)  # fmt: skip
            assert torch_backend.uses_cpu_kernel == (kind == "kernel")
            self.backend = torch_backend
        self.static_sizes = sorted(static_sizes)
        self.static_steps = 0
        if static_sizes:
            self.backend.enable_static_decode(self.static_sizes, max_pages_per_seq=16)
        self.free = list(range(self.pool.num_pages))
        self.rng.shuffle(self.free)  # non-contiguous, unordered page tables
        self.pages: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}
        self.outputs: list[torch.Tensor] = []
        self.worst = 0.0

    def _grow(self, seq: int, total: int) -> None:
        pages = self.pages.setdefault(seq, [])
        while len(pages) * self.page_size < total + self.rng.randint(0, 1):  # tables may hold spare pages
            pages.append(self.free.pop())

    def _randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape).to(self.dtype).to(self.device)

    def stored(self, which: str, layer: int, seq: int, end: int) -> torch.Tensor:
        """``seq``'s k or v of positions 0..end-1 as the pool holds them, dequantized to the model dtype."""
        pool, table = self.pool, self.pages[seq]
        slots = torch.tensor([table[p // self.page_size] * self.page_size + p % self.page_size for p in range(end)],
                             device=self.device)  # fmt: skip
        rows = getattr(pool, f"{which}_caches")[layer].view(-1, pool.num_kv_heads, pool.head_dim)
        rows = rows.view(torch.uint8)[slots].view(rows.dtype)  # as bytes: no fp8 indexing on the CPU
        if not pool.is_quantized:
            return rows
        scales = getattr(pool, f"{which}_scales")[layer].view(-1, pool.num_kv_heads)[slots]
        return dequantize_kv(rows, scales, pool.dtype)

    def step(self, work: list[tuple[int, int]]) -> None:
        """One engine step of (seq, new tokens); every layer against ``windowed_dense``."""
        ctxs = [self.lengths.get(s, 0) + n for s, n in work]
        for (s, _), c in zip(work, ctxs, strict=True):
            self._grow(s, c)
            self.lengths[s] = c
        layout = StepLayout([n for _, n in work], ctxs, [list(self.pages[s]) for s, _ in work])
        total = rows = sum(n for _, n in work)
        if self.static_sizes and all(n == 1 for _, n in work) and total <= self.static_sizes[-1]:
            rows = min(size for size in self.static_sizes if size >= total)
            self.backend.plan_static_decode(rows, layout)
            self.static_steps += 1
        else:
            self.backend.plan(layout)
        for layer, window in enumerate(self.windows):
            # q as a strided slice, as the fused qkv projection hands it over; padding rows past ``total``.
            q = self._randn(rows, self.heads[0] + 1, self.head_dim)[:, : self.heads[0]]
            k, v = self._randn(rows, self.heads[1], self.head_dim), self._randn(rows, self.heads[1], self.head_dim)
            out = self.backend.forward(layer, q, k, v)[:total]
            assert out.shape == (total, self.heads[0], self.head_dim) and out.dtype == self.dtype
            self.outputs.append(out.cpu())
            row = 0
            for (s, n), c in zip(work, ctxs, strict=True):
                hist_k, hist_v = self.stored("k", layer, s, c), self.stored("v", layer, s, c)
                for true, kept in ((k[row : row + n], hist_k[c - n :]), (v[row : row + n], hist_v[c - n :])):
                    if self.pool.is_quantized:  # a coarse check: attention runs over the stored values
                        assert ((true.float() - kept.float()).abs() <= true.float().abs().amax() / 8).all()
                    else:
                        assert torch.equal(true, kept)
                want = windowed_dense(q[row : row + n].cpu(), hist_k.cpu(), hist_v.cpu(), c - n, window, self.scale)
                self.worst = max(self.worst, (self.outputs[-1][row : row + n].double() - want).abs().max().item())
                row += n

    def run_workload(self) -> None:
        """Cached prefixes continued by chunked prefill, decodes joining, fresh prompts alone and in groups."""
        prompts = {s: self.rng.randint(1, 90) for s in range(6)}
        for work in chunked_prefill(prompts, 24):
            self.step(work)
        for _ in range(3):
            self.step([(s, 1) for s in prompts])  # decode-only
        self.step([(0, 1), (9, 33), (2, 1)])  # a new prompt among decodes
        self.step([(10, 20), (11, 20)])  # equal fresh prompts: the torch path's causal group
        self.step([(12, 45)])  # one fresh prompt, longer than the short window
        self.step([(s, 1) for s in (*prompts, 9, 10, 11, 12)])


def _check(driver: Driver, request: pytest.FixtureRequest) -> None:
    driver.run_workload()
    request.node.user_properties.append(("max_abs_diff", driver.worst))
    assert driver.worst <= TOLERANCE[driver.dtype], driver.worst


HEADS = [(8, 2), (8, 1)]  # GQA, MQA
HEAD_IDS = ["gqa", "mqa"]
DTYPES = [torch.float32, torch.bfloat16]
DTYPE_IDS = ["fp32", "bf16"]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("kind", ["kernel", "torch", "flashinfer"])
def test_windows_match_dense_attention(kind: Kind, heads: tuple[int, int], page_size: int, dtype: torch.dtype,
                                       request: pytest.FixtureRequest) -> None:  # fmt: skip
    # A softmax scale other than 1/sqrt(head_dim), as Gemma's query_pre_attn_scalar gives.
    scale = 0.3 if page_size == 16 else None
    _check(Driver(kind, heads=heads, page_size=page_size, dtype=dtype, seed=page_size + heads[1],
                  windows=WINDOWS, scale=scale), request)  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("kind", ["kernel", "torch"])
def test_quantized_pools_match_their_dequantized_pages(kind: Kind, kv_dtype: str, dtype: torch.dtype,
                                                       request: pytest.FixtureRequest) -> None:  # fmt: skip
    heads = HEADS[len(kv_dtype) % 2]
    _check(Driver(kind, heads=heads, page_size=16, dtype=dtype, seed=7, windows=WINDOWS, kv_dtype=kv_dtype), request)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("page_size", [16, 32])
def test_flashinfer_fp8_pages_match_their_dequantized_pages(page_size: int, dtype: torch.dtype,
                                                            request: pytest.FixtureRequest) -> None:  # fmt: skip
    _check(Driver("flashinfer", heads=(8, 2), page_size=page_size, dtype=dtype, seed=3, windows=WINDOWS,
                  kv_dtype="fp8_e4m3"), request)  # fmt: skip


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
def test_flashinfer_static_decode_with_windows(heads: tuple[int, int], dtype: torch.dtype, kv_dtype: str,
                                               request: pytest.FixtureRequest) -> None:  # fmt: skip
    """Decode-only steps padded to sizes 2 and 8 on the static buffers, one graph wrapper per window and size."""
    driver = Driver("flashinfer", heads=heads, page_size=16, dtype=dtype, seed=5, windows=WINDOWS,
                    kv_dtype=kv_dtype, scale=0.25, static_sizes=(2, 8))  # fmt: skip
    _check(driver, request)
    assert driver.static_steps >= 3
    backend = driver.backend
    assert isinstance(backend, FlashInferPagedAttention)
    lefts = sorted({-1 if w is None else w - 1 for w in WINDOWS})
    assert sorted(backend.static_decode_wrappers) == lefts
    wrappers = [w for by_size in backend.static_decode_wrappers.values() for w in by_size.values()]
    assert len({id(w) for w in wrappers}) == len(lefts) * 2
    assert all(w.is_cuda_graph_enabled for w in wrappers)  # type: ignore[attr-defined]


def test_flashinfer_wrappers_one_set_per_window_on_one_workspace() -> None:
    driver = Driver("flashinfer", heads=(8, 2), page_size=16, dtype=torch.float32, seed=1,
                    windows=(13, None, 13, 40))  # fmt: skip
    backend = driver.backend
    assert isinstance(backend, FlashInferPagedAttention)
    assert backend.window_lefts == (12, -1, 12, 39)
    assert sorted(backend.prefill_wrappers) == sorted(backend.decode_wrappers) == [-1, 12, 39]
    wrappers = [*backend.prefill_wrappers.values(), *backend.decode_wrappers.values()]
    assert all(w.float_workspace_buffer is backend.workspace for w in wrappers)  # type: ignore[attr-defined]
    assert backend.prefill is backend.prefill_wrappers[12] and backend.decode is backend.decode_wrappers[12]
    driver.step([(0, 30), (1, 5)])
    driver.step([(0, 1), (1, 1)])
    # Every window's wrapper planned once per step of its kind, run once per layer of its window.
    for wl, layers in ((-1, 1), (12, 2), (39, 1)):
        for w in (backend.prefill_wrappers[wl], backend.decode_wrappers[wl]):
            assert isinstance(w, (flashinfer_emulator.BatchPrefillWithPagedKVCacheWrapper,
                                  flashinfer_emulator.BatchDecodeWithPagedKVCacheWrapper))  # fmt: skip
            assert (w.num_plans, w.num_runs) == (1, layers)


@pytest.mark.parametrize("kind", ["kernel", "torch", "flashinfer"])
def test_no_window_is_bit_identical(kind: Kind) -> None:
    """None, one None per layer and windows longer than every context give the same bits as no argument."""
    runs = []
    cases: list[tuple[Sequence[int | None] | None, bool]] = [
        (None, False), (None, True), ((None,) * 3, True), ((10_000, 500, 10_000), True),
    ]  # fmt: skip
    for windows, pass_windows in cases:
        driver = Driver(kind, heads=(8, 2), page_size=16, dtype=torch.float32, seed=2, num_layers=3,
                        windows=windows, pass_windows=pass_windows)  # fmt: skip
        driver.run_workload()
        assert driver.worst <= TOLERANCE[torch.float32]
        runs.append(driver.outputs)
        if isinstance(driver.backend, TorchPagedAttention):  # no window bites: no mask built for one
            plan = driver.backend._plan
            assert plan is not None and all(g.window_masks == {} for g in plan.groups)
    for other in runs[1:]:
        assert len(other) == len(runs[0])
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other, strict=True))


@pytest.mark.parametrize("kind", ["kernel", "torch", "flashinfer"])
def test_window_of_one_sees_only_itself(kind: Kind) -> None:
    """Window 1: every output row is its own value row, on every path."""
    driver = Driver(kind, heads=(4, 4), page_size=16, dtype=torch.float32, seed=4, windows=(1,))
    driver.step([(0, 20), (1, 3)])
    driver.step([(0, 1), (1, 1)])
    driver.step([(0, 1), (1, 5)])
    assert driver.worst <= 1e-6, (kind, driver.worst)


@pytest.mark.parametrize("bad", [[4], [4, None, 4], [0, None], [-3, None], [2.5, None], [True, None], "ab"])
@pytest.mark.parametrize("kind", ["torch", "flashinfer"])
def test_bad_windows_are_refused(kind: str, bad: Any) -> None:
    pool = KVPool(num_layers=2, num_pages=8, page_size=16, num_kv_heads=2, head_dim=HEAD_DIM, dtype=torch.float32)
    with pytest.raises(ValueError, match="sliding_windows|window"):
        if kind == "torch":
            TorchPagedAttention(pool, num_heads=8, num_kv_heads=2, head_dim=HEAD_DIM, sliding_windows=bad)
        else:
            FlashInferPagedAttention(pool, flashinfer_emulator, num_heads=8, num_kv_heads=2, head_dim=HEAD_DIM,
                                     workspace_bytes=1 << 12, sliding_windows=bad)  # fmt: skip
    backend = TorchPagedAttention(pool, num_heads=8, num_kv_heads=2, head_dim=HEAD_DIM, sliding_windows=[3, None])
    assert backend.sliding_windows == (3, None)


def test_window_helpers_and_group_masks() -> None:
    assert [meta.window_start(p, 4) for p in (0, 3, 4, 10)] == [0, 0, 1, 7]
    assert meta.window_start(10, None) == 0
    assert not meta.window_hides_keys(4, 4) and meta.window_hides_keys(5, 4)
    assert not meta.window_hides_keys(10**6, None)
    assert meta.check_sliding_windows(None, 3) == (None, None, None)
    # Two decodes of contexts 5 and 9 (page 4); windows 3 and 9: only 3 hides a key.
    layout = StepLayout([1, 1], [5, 9], [[0, 1], [2, 3, 4]])
    group = meta.build_attention_group(layout, [0, 1], 4, 2, windows=(3, 9))
    assert list(group.window_masks) == [3] and group.mask is not None
    want = torch.tensor([[0, 0, 1, 1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(group.window_masks[3].view(2, 9), want)
    # Equal fresh prompts keep the causal path for unwindowed layers and get a mask for the window.
    fresh = StepLayout([4, 4], [4, 4], [[0], [1]])
    causal = meta.build_attention_group(fresh, [0, 1], 4, 1, windows=(2,), mask_dtype=torch.float32)
    assert causal.causal and causal.mask is None
    rows = torch.isfinite(causal.window_masks[2][0, 0])
    assert torch.equal(rows, torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]).bool())


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("window", [1, 5, 16, 17, 100, 1000])
def test_raw_kernel_window_skips_pages_before_it(ext: Any, window: int, page_size: int, dtype: torch.dtype) -> None:
    """Page-table entries wholly before the window hold junk: the kernel neither reads nor checks them."""
    rng = random.Random(window * 31 + page_size)
    torch.manual_seed(window)
    prob = random_problem(rng, batch=23, heads=(8, 2), head_dim=64, page_size=page_size, max_ctx=300, dtype=dtype)
    table, ctxs = prob["table"], prob["ctxs"]
    k, v = prob["k"].reshape(-1, 2, 64), prob["v"].reshape(-1, 2, 64)
    want = []
    for b, c in enumerate(ctxs):
        pos = torch.arange(c)
        slots = table[b].long()[pos // page_size] * page_size + pos % page_size
        want.append(windowed_dense(prob["q"][b : b + 1], k[slots], v[slots], c - 1, window, 0.2))
        table[b, : meta.window_start(c - 1, window) // page_size] = -12345
    ext.paged_decode(prob["out"], prob["q"], prob["k"], prob["v"], table, torch.tensor(ctxs), 0.2, window=window)
    tol = TOLERANCE[dtype] * (2 if dtype == torch.float32 else 1)
    torch.testing.assert_close(prob["out"].double(), torch.cat(want), atol=tol, rtol=tol)


def test_raw_kernel_window_zero_is_the_old_call(ext: Any) -> None:
    prob = random_problem(random.Random(3), batch=9, heads=(8, 1), head_dim=32, page_size=16, max_ctx=200)
    ctxs = torch.tensor(prob["ctxs"])
    ext.paged_decode(prob["out"], prob["q"], prob["k"], prob["v"], prob["table"], ctxs, 0.3)
    old = prob["out"].clone()
    for extra in ({"window": 0}, {"window": 200}):  # none, and one no context exceeds
        prob["out"].fill_(float("nan"))
        ext.paged_decode(prob["out"], prob["q"], prob["k"], prob["v"], prob["table"], ctxs, 0.3, **extra)
        assert torch.equal(prob["out"], old)
    with pytest.raises(RuntimeError, match="window"):
        ext.paged_decode(prob["out"], prob["q"], prob["k"], prob["v"], prob["table"], ctxs, 0.3, window=-1)


@pytest.mark.parametrize("window", [1, 6, 16, 40])
@pytest.mark.parametrize("causal", [True, False])
def test_emulator_window_left(window: int, causal: bool) -> None:
    """The emulator's ``window_left = w - 1`` against dense windowed attention, prefill and decode."""
    torch.manual_seed(window)
    page_size, reqs = 16, [(5, 30), (1, 17), (12, 12), (3, 70)]  # (queries, keys)
    num_pages = 20
    k = torch.randn(num_pages, page_size, 2, HEAD_DIM)
    v = torch.randn(num_pages, page_size, 2, HEAD_DIM)
    free = list(range(num_pages))
    random.Random(window).shuffle(free)
    tables = [[free.pop() for _ in range(meta.num_pages_for(c, page_size))] for _, c in reqs]
    layout = StepLayout([q for q, _ in reqs], [c for _, c in reqs], tables)
    idx = meta.build_flashinfer_indices(layout, page_size)
    q = torch.randn(sum(layout.query_lens), 8, HEAD_DIM)
    workspace = torch.zeros(16, dtype=torch.uint8)
    prefill = flashinfer_emulator.BatchPrefillWithPagedKVCacheWrapper(workspace)
    prefill.plan(idx["qo_indptr"], idx["paged_kv_indptr"], idx["paged_kv_indices"], idx["paged_kv_last_page_len"],
                 8, 2, HEAD_DIM, page_size, causal=causal, window_left=window - 1, q_data_type=torch.float32)  # fmt: skip
    out = prefill.run(q, (k, v))
    row = 0
    for (n, c), pages in zip(reqs, tables, strict=True):
        hist_k, hist_v = k[pages].flatten(0, 1)[:c], v[pages].flatten(0, 1)[:c]
        if causal:
            want = windowed_dense(q[row : row + n], hist_k, hist_v, c - n, window, HEAD_DIM**-0.5)
            torch.testing.assert_close(out[row : row + n].double(), want, atol=1e-5, rtol=1e-5)
        elif n == 1:  # a decode-shaped request: the same keys with or without causal
            want = windowed_dense(q[row : row + 1], hist_k, hist_v, c - 1, window, HEAD_DIM**-0.5)
            torch.testing.assert_close(out[row : row + 1].double(), want, atol=1e-5, rtol=1e-5)
        row += n
    with pytest.raises(ValueError, match="window_left"):
        prefill.run(q, (k, v), window_left=window)
    decode = flashinfer_emulator.BatchDecodeWithPagedKVCacheWrapper(workspace)
    decode.plan(idx["paged_kv_indptr"], idx["paged_kv_indices"], idx["paged_kv_last_page_len"], 8, 2, HEAD_DIM,
                page_size, window_left=window - 1, q_data_type=torch.float32)  # fmt: skip
    last = torch.tensor([s + n - 1 for s, (n, _) in zip(meta.token_starts(layout.query_lens), reqs, strict=True)])
    got = decode.run(q[last], (k, v))
    for b, ((_, c), pages) in enumerate(zip(reqs, tables, strict=True)):
        hist_k, hist_v = k[pages].flatten(0, 1)[:c], v[pages].flatten(0, 1)[:c]
        want = windowed_dense(q[last[b] : last[b] + 1], hist_k, hist_v, c - 1, window, HEAD_DIM**-0.5)
        torch.testing.assert_close(got[b : b + 1].double(), want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="window_left"):
        decode.plan(idx["paged_kv_indptr"], idx["paged_kv_indices"], idx["paged_kv_last_page_len"], 8, 2, HEAD_DIM,
                    page_size, window_left=-2, q_data_type=torch.float32)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and flashinfer_installed()), reason="needs CUDA and flashinfer")
@pytest.mark.parametrize("static_sizes", [(), (2, 8)], ids=["dynamic", "static_decode"])
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8_e4m3"])
def test_real_flashinfer_windows_on_cuda(kv_dtype: str, static_sizes: tuple[int, ...],
                                         request: pytest.FixtureRequest) -> None:  # fmt: skip
    """The real kernels' ``window_left`` against dense attention (static decode run eagerly)."""
    # head_dim 128: a size every FlashInfer build has kernels for.
    driver = Driver("flashinfer", heads=(8, 2), page_size=16, dtype=torch.bfloat16, seed=1, windows=WINDOWS,
                    kv_dtype=kv_dtype, scale=0.05, static_sizes=static_sizes, kernels=load_flashinfer(),
                    device="cuda", head_dim=128)  # fmt: skip
    _check(driver, request)
    assert driver.static_steps >= (3 if static_sizes else 0)
