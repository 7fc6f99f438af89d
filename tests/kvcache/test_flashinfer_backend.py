"""FlashInferPagedAttention under the CPU emulator against TorchPagedAttention, dense attention and the engine.

Every case runs the FlashInfer backend's index building, wrapper choice and
call sequence on the CPU (``flashinfer_emulator``); the ``gpu`` case runs the
same comparison with the real flashinfer on CUDA.
"""

from __future__ import annotations

import random
from types import ModuleType

import pytest
import torch

from actors.config import EngineConfig
from actors.runner.model_runner import make_attention_backend
from apps.llm import LLM
from kvcache.attention.backend import StepLayout
from kvcache.attention.flashinfer import (
    FP8_KV_SCALE,
    WORKSPACE_BYTES,
    FlashInferKernels,
    FlashInferPagedAttention,
    flashinfer_installed,
    load_flashinfer,
)
from kvcache.attention.torch_paged import TorchPagedAttention
from kvcache.errors import CacheConfigError
from kvcache.kv_pool import KVPool
from kvcache.kv_quant import dequantize_kv
from scheduling.errors import InvalidParameterError
from scheduling.sampling_params import SamplingParams
from tests.kvcache import flashinfer_emulator
from tests.kvcache.test_torch_attention import dense_attention

HEAD_DIM = 32
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _pool(heads: tuple[int, int], page_size: int, dtype: torch.dtype, device: str = "cpu", kv_dtype: str = "auto",
          num_layers: int = 2, head_dim: int = HEAD_DIM) -> KVPool:  # fmt: skip
    return KVPool(num_layers=num_layers, num_pages=160, page_size=page_size, num_kv_heads=heads[1],
                  head_dim=head_dim, dtype=dtype, device=device, kv_dtype=kv_dtype)  # fmt: skip


def _flashinfer(pool: KVPool, heads: tuple[int, int], kernels: FlashInferKernels | ModuleType) -> FlashInferPagedAttention:
    return FlashInferPagedAttention(pool, kernels, num_heads=heads[0], num_kv_heads=heads[1], head_dim=pool.head_dim,  # type: ignore[arg-type]
                                    workspace_bytes=1 << 12 if pool.device.type == "cpu" else WORKSPACE_BYTES)


class Pair:
    """The FlashInfer backend and the torch reference over two pools holding the same pages."""

    def __init__(self, heads: tuple[int, int], page_size: int, dtype: torch.dtype, seed: int,
                 kernels: FlashInferKernels | ModuleType = flashinfer_emulator, device: str = "cpu",
                 head_dim: int = HEAD_DIM) -> None:  # fmt: skip
        self.rng = random.Random(seed)
        torch.manual_seed(seed)
        self.heads, self.page_size, self.dtype, self.device = heads, page_size, dtype, device
        self.head_dim = head_dim
        self.ref_pool = _pool(heads, page_size, dtype, device, head_dim=head_dim)
        self.fi_pool = _pool(heads, page_size, dtype, device, head_dim=head_dim)
        self.ref = TorchPagedAttention(self.ref_pool, num_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim)
        self.fi = _flashinfer(self.fi_pool, heads, kernels)
        self.free = list(range(self.fi_pool.num_pages))
        self.rng.shuffle(self.free)  # non-contiguous, unordered page tables
        self.pages: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}
        self.worst = 0.0

    def _grow(self, seq: int, total: int) -> None:
        pages = self.pages.setdefault(seq, [])
        while len(pages) * self.page_size < total + self.rng.randint(0, 1):  # tables may hold spare pages
            pages.append(self.free.pop())

    def _randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape).to(self.dtype).to(self.device)

    def cached_prefix(self, seq: int, n: int) -> None:
        """``n`` tokens of ``seq`` already in both pools (a prefix-cache hit), byte for byte."""
        self._grow(seq, n)
        slots = torch.tensor([self.pages[seq][p // self.page_size] * self.page_size + p % self.page_size
                              for p in range(n)], device=self.device)  # fmt: skip
        for layer in range(self.fi_pool.num_layers):
            for name in ("k_caches", "v_caches"):
                values = self._randn(n, self.heads[1], self.head_dim)
                for pool in (self.ref_pool, self.fi_pool):
                    getattr(pool, name)[layer].view(-1, self.heads[1], self.head_dim)[slots] = values
        self.lengths[seq] = n

    def step(self, work: list[tuple[int, int]]) -> None:
        """One engine step of (seq, new tokens); both backends must agree on every layer."""
        ctxs = [self.lengths.get(s, 0) + n for s, n in work]
        for (s, _), c in zip(work, ctxs, strict=True):
            self._grow(s, c)
            self.lengths[s] = c
        layout = StepLayout([n for _, n in work], ctxs, [list(self.pages[s]) for s, _ in work])
        wrapper = self.fi.decode if all(n == 1 for _, n in work) else self.fi.prefill
        counts = (getattr(wrapper, "num_plans", 0), getattr(wrapper, "num_runs", 0))  # the emulator's
        self.ref.plan(layout)
        self.fi.plan(layout)
        total = sum(n for _, n in work)
        for layer in range(self.fi_pool.num_layers):
            # q as a strided slice, as the fused qkv projection hands it over.
            q = self._randn(total, self.heads[0] + 1, self.head_dim)[:, : self.heads[0]]
            k, v = self._randn(total, self.heads[1], self.head_dim), self._randn(total, self.heads[1], self.head_dim)
            want, got = self.ref.forward(layer, q, k, v), self.fi.forward(layer, q, k, v)
            assert got.shape == want.shape and got.dtype == want.dtype
            self.worst = max(self.worst, (got.float() - want.float()).abs().max().item())
        if isinstance(wrapper, (flashinfer_emulator.BatchPrefillWithPagedKVCacheWrapper,
                                flashinfer_emulator.BatchDecodeWithPagedKVCacheWrapper)):  # fmt: skip
            # One plan per step on the wrapper the step needs, one run per layer.
            assert (wrapper.num_plans, wrapper.num_runs) == (counts[0] + 1, counts[1] + self.fi_pool.num_layers)

    def run_workload(self) -> None:
        """Prefix hits, chunked prefill under a token budget, decodes joining as prompts finish, mixed steps."""
        prompts = {s: self.rng.randint(1, 70) for s in range(6)}
        for s in (1, 4):
            self.cached_prefix(s, self.rng.randint(5, 40))
        remaining = dict(prompts)
        while any(remaining.values()):
            budget, work = 24, []
            for s in prompts:
                if remaining[s] == 0:
                    work.append((s, 1))
                    budget -= 1
                elif budget > 0:
                    n = min(remaining[s], budget)
                    remaining[s], budget = remaining[s] - n, budget - n
                    work.append((s, n))
            self.step(work)
        for _ in range(3):
            self.step([(s, 1) for s in prompts])  # decode-only
        self.step([(0, 1), (9, 33), (2, 1)])  # a new prompt among decodes


HEADS = [(8, 2), (6, 2), (8, 1), (4, 4)]  # GQA 4 (tensor-core decode), GQA 3, MQA, MHA


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("heads", HEADS, ids=[f"{h}q{k}kv" for h, k in HEADS])
def test_matches_torch_paged_attention(heads: tuple[int, int], page_size: int, dtype: torch.dtype) -> None:
    pair = Pair(heads, page_size, dtype, seed=page_size + heads[0] * 7 + heads[1])
    pair.run_workload()
    assert pair.worst <= TOLERANCE[dtype], pair.worst
    # Both wrote the same k/v at the same slots.
    for a, b in zip(pair.ref_pool.k_caches + pair.ref_pool.v_caches,
                    pair.fi_pool.k_caches + pair.fi_pool.v_caches, strict=True):  # fmt: skip
        assert torch.equal(a, b)
    assert pair.fi.decode.use_tensor_cores == (heads[0] // heads[1] >= 4)  # type: ignore[attr-defined]
    assert pair.fi.prefill.float_workspace_buffer is pair.fi.decode.float_workspace_buffer  # type: ignore[attr-defined]


def _stored(values: torch.Tensor, scales: list[torch.Tensor] | None, pages: list[int], n: int) -> torch.Tensor:
    """The first ``n`` tokens in ``pages`` of a one-layer fp8 pool, dequantized with their stored scales."""
    assert scales is not None
    index = torch.tensor(pages)
    raw = values.view(torch.uint8)[index].view(torch.float8_e4m3fn).flatten(0, 1)[:n]
    scale = scales[0][index].flatten(0, 1)[:n]
    assert (scale == FP8_KV_SCALE).all()  # the one scale FlashInfer is told, for every token
    return dequantize_kv(raw, scale, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fp8_pages_match_their_dequantized_reference(dtype: torch.dtype) -> None:
    heads, page_size = (8, 2), 16
    pool = _pool(heads, page_size, dtype, kv_dtype="fp8_e4m3", num_layers=1)
    backend = _flashinfer(pool, heads, flashinfer_emulator)
    torch.manual_seed(0)
    tables = [list(range(0, 4)), list(range(10, 13)), list(range(20, 24))]
    hist_k: list[torch.Tensor] = [torch.empty(0, heads[1], HEAD_DIM, dtype=dtype) for _ in tables]
    hist_v = list(hist_k)
    # A prompt, then a chunk with decodes beside it, then decodes only.
    for qlens in ([9, 20, 1], [1, 13, 30], [1, 1, 1]):
        ctxs = [h.shape[0] + n for h, n in zip(hist_k, qlens, strict=True)]
        backend.plan(StepLayout(qlens, ctxs, tables))
        q = torch.randn(sum(qlens), heads[0], HEAD_DIM).to(dtype)
        k, v = (torch.randn(sum(qlens), heads[1], HEAD_DIM) * 3).to(dtype), torch.randn(sum(qlens), heads[1], HEAD_DIM).to(dtype)
        out = backend.forward(0, q, k, v)
        row = 0
        for i, (n, c) in enumerate(zip(qlens, ctxs, strict=True)):
            hist_k[i] = torch.cat([hist_k[i], k[row : row + n]])
            hist_v[i] = torch.cat([hist_v[i], v[row : row + n]])
            sk = _stored(pool.k_caches[0], pool.k_scales, tables[i], c)
            sv = _stored(pool.v_caches[0], pool.v_scales, tables[i], c)
            for true, kept in ((hist_k[i], sk), (hist_v[i], sv)):  # fp8's error bound at scale 1
                assert ((true.float() - kept).abs() <= true.float().abs() / 16 + 1 / 1024).all()
            ref = dense_attention(q[row : row + n], sk, sv, c - n)
            tol = TOLERANCE[dtype]
            torch.testing.assert_close(out[row : row + n].double(), ref, atol=tol, rtol=tol)
            row += n


def test_int8_pages_are_refused_by_name() -> None:
    pool = _pool((8, 2), 16, torch.float32, kv_dtype="int8")
    with pytest.raises(CacheConfigError) as err:
        _flashinfer(pool, (8, 2), flashinfer_emulator)
    assert err.value.param == "kv_cache_dtype" and "int8" in err.value.message
    with pytest.raises(InvalidParameterError) as cfg_err:
        EngineConfig(attention_backend="flashinfer", attention_kernels=flashinfer_emulator, device="cpu",
                     kv_cache_dtype="int8")  # type: ignore[arg-type]
    assert cfg_err.value.param == "kv_cache_dtype"


def test_an_empty_step_returns_no_rows_and_plans_nothing() -> None:
    pair = Pair((8, 2), 16, torch.float32, seed=0)
    pair.fi.plan(StepLayout([], [], []))
    out = pair.fi.forward(0, torch.empty(0, 8, HEAD_DIM), torch.empty(0, 2, HEAD_DIM), torch.empty(0, 2, HEAD_DIM))
    assert out.shape == (0, 8, HEAD_DIM)
    assert pair.fi.prefill.num_plans == pair.fi.decode.num_plans == 0  # type: ignore[attr-defined]


def test_flashinfer_is_refused_by_name_where_it_cannot_run() -> None:
    # On the CPU without injected kernels: no fallback to torch, a refusal naming the setting.
    with pytest.raises(InvalidParameterError) as err:
        EngineConfig(attention_backend="flashinfer", device="cpu")
    assert err.value.param == "attention_backend" and "CUDA" in err.value.message
    with pytest.raises(InvalidParameterError) as err:
        EngineConfig(attention_backend="torch", attention_kernels=flashinfer_emulator)  # type: ignore[arg-type]
    assert err.value.param == "attention_kernels"
    with pytest.raises(InvalidParameterError) as err:
        EngineConfig(attention_backend="flashinfer", attention_kernels="flashinfer", device="cpu")  # type: ignore[arg-type]
    assert err.value.param == "attention_kernels"
    with pytest.raises(InvalidParameterError) as err:
        EngineConfig(attention_backend="flashinfer", device="cuda", dtype="float32")
    assert err.value.param == "dtype"
    if not flashinfer_installed():
        with pytest.raises(InvalidParameterError) as err:
            EngineConfig(attention_backend="flashinfer", device="cuda")
        assert err.value.param == "attention_backend" and "cuda" in err.value.message
        with pytest.raises(CacheConfigError) as load_err:
            load_flashinfer()
        assert load_err.value.param == "attention_backend" and "`cuda` extra" in load_err.value.message


def test_injected_kernels_make_the_runner_build_the_flashinfer_backend() -> None:
    config = EngineConfig(attention_backend="flashinfer", attention_kernels=flashinfer_emulator, device="cpu")  # type: ignore[arg-type]
    assert config.resolved_attention_backend() == "flashinfer"
    pool = _pool((8, 2), 16, torch.float32)
    backend = make_attention_backend(config, pool, num_heads=8, num_kv_heads=2, head_dim=HEAD_DIM)
    assert isinstance(backend, FlashInferPagedAttention)
    assert backend.workspace.numel() == WORKSPACE_BYTES and not backend.workspace.any()


ENGINE = {"max_model_len": 256, "max_num_seqs": 8, "dtype": "float32", "device": "cpu"}
MODES = {
    "prefix_on": {},
    "chunked_small_budget": {"max_num_batched_tokens": 16},
    "preemption": {"num_kv_pages": 40, "page_size": 4, "max_model_len": 128},
}


def _prompts() -> list[list[int]]:
    rng = random.Random(11)
    shared = [rng.randrange(3, 256) for _ in range(24)]
    return [(shared if i % 2 else []) + [rng.randrange(3, 256) for _ in range(rng.randint(1, 40))] for i in range(8)]


@pytest.mark.parametrize("mode", list(MODES))
def test_engine_on_the_emulator_gives_the_torch_backends_greedy_tokens(mode: str) -> None:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outputs = []
    for backend in ({}, {"attention_backend": "flashinfer", "attention_kernels": flashinfer_emulator}):
        llm = LLM("tiny", **{**ENGINE, **MODES[mode], **backend})
        outputs.append([o.outputs[0].token_ids for o in llm.generate(_prompts(), params, use_tqdm=False)])
        if mode == "prefix_on":  # a second pass reads every prompt's pages from the prefix cache
            again = llm.generate(_prompts(), params, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in again] == outputs[-1]
            assert sum(o.num_cached_tokens for o in again) > 0
        if backend:
            assert isinstance(llm.engine.executor.runner.attn, FlashInferPagedAttention)  # type: ignore[attr-defined]
            sched = llm.engine.scheduler
            if sched.cache is not None:
                assert sched.cache.num_locked_pages == 0
                sched.cache.reset()
            assert mode != "preemption" or sched.stats.num_preemptions > 0
            sched.allocator.check_integrity()
            assert sched.allocator.num_free_pages == sched.allocator.num_pages
        llm.shutdown()
    assert outputs[0] == outputs[1]


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and flashinfer_installed()), reason="needs CUDA and flashinfer")
@pytest.mark.parametrize("heads", [(8, 2), (8, 1)], ids=["gqa4", "mqa"])
def test_real_flashinfer_matches_torch_paged_attention_on_cuda(heads: tuple[int, int]) -> None:
    # head_dim 128: a size every FlashInfer build has kernels for.
    pair = Pair(heads, 16, torch.bfloat16, seed=1, kernels=load_flashinfer(), device="cuda", head_dim=128)
    pair.run_workload()
    assert pair.worst <= TOLERANCE[torch.bfloat16], pair.worst
