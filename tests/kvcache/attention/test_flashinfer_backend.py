"""FlashInferPagedAttention under the CPU emulator against TorchPagedAttention.

Every case runs the FlashInfer backend's index building, wrapper choice and
call sequence on the CPU (``flashinfer_emulator``); the ``gpu`` case runs the
same comparison with the real flashinfer on CUDA. The engine on this backend
is checked against transformers in every scheduling mode by the oracles
(tests/actors/engine/test_engine_oracle.py, tests/actors/load/test_smollm2_oracle.py).
"""

from __future__ import annotations

import random
from types import ModuleType

import pytest
import torch

from actors.config import EngineConfig
from actors.runner.model_runner import make_attention_backend
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
from kvcache.kv_transfer import KVPayloadMismatchError
from scheduling.errors import InvalidParameterError
from tests.kvcache import flashinfer_emulator
from tests.kvcache.workloads import chunked_prefill

HEAD_DIM = 32
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _pool(heads: tuple[int, int], page_size: int, dtype: torch.dtype, device: str = "cpu", kv_dtype: str = "auto",
          num_layers: int = 2, head_dim: int = HEAD_DIM, pad_page: bool = False) -> KVPool:  # fmt: skip
    return KVPool(num_layers=num_layers, num_pages=160, page_size=page_size, num_kv_heads=heads[1],
                  head_dim=head_dim, dtype=dtype, device=device, kv_dtype=kv_dtype, pad_page=pad_page)  # fmt: skip


def _flashinfer(pool: KVPool, heads: tuple[int, int], kernels: FlashInferKernels | ModuleType) -> FlashInferPagedAttention:
    return FlashInferPagedAttention(pool, kernels, num_heads=heads[0], num_kv_heads=heads[1], head_dim=pool.head_dim,  # type: ignore[arg-type]
                                    workspace_bytes=1 << 12 if pool.device.type == "cpu" else WORKSPACE_BYTES)


class Pair:
    """The FlashInfer backend and the torch reference over two pools holding the same pages.

    With ``kv_dtype="fp8_e4m3"`` the FlashInfer pool stores fp8 and the
    reference pool (model dtype) holds those pages dequantized with their
    stored scales: every k/v the FlashInfer backend writes is read back from
    its pool, checked to be within fp8's rounding error of what was written,
    and handed to the reference as stored. So the reference attends over
    exactly the pages FlashInfer reads, and one tolerance serves both formats.

    With ``static_sizes``, decode-only steps take the static-shape path
    (``plan_static_decode``, what a CUDA graph replays) at the smallest of
    those sizes that holds them, padding rows carrying random q/k/v; only
    the real rows are compared, and the pad page is the one page the
    padding may write (``assert_same_pages`` covers every other).
    """

    def __init__(self, heads: tuple[int, int], page_size: int, dtype: torch.dtype, seed: int,
                 kernels: FlashInferKernels | ModuleType = flashinfer_emulator, device: str = "cpu",
                 head_dim: int = HEAD_DIM, kv_dtype: str = "auto", static_sizes: tuple[int, ...] = ()) -> None:  # fmt: skip
        self.rng = random.Random(seed)
        torch.manual_seed(seed)
        self.heads, self.page_size, self.dtype, self.device = heads, page_size, dtype, device
        self.head_dim = head_dim
        self.ref_pool = _pool(heads, page_size, dtype, device, head_dim=head_dim)
        self.fi_pool = _pool(heads, page_size, dtype, device, head_dim=head_dim, kv_dtype=kv_dtype,
                             pad_page=bool(static_sizes))  # fmt: skip
        self.ref = TorchPagedAttention(self.ref_pool, num_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim)
        self.fi = _flashinfer(self.fi_pool, heads, kernels)
        self.static_sizes = sorted(static_sizes)
        self.static_steps = 0
        if static_sizes:
            self.fi.enable_static_decode(self.static_sizes, max_pages_per_seq=16)
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

    def _slots(self, seq: int, start: int, end: int) -> torch.Tensor:
        """Flat pool slots of ``seq``'s positions ``start..end-1``, from its page table."""
        table = self.pages[seq]
        return torch.tensor([table[p // self.page_size] * self.page_size + p % self.page_size
                             for p in range(start, end)], dtype=torch.int64, device=self.device)  # fmt: skip

    def _stored(self, which: str, layer: int, slots: torch.Tensor | None = None) -> torch.Tensor:
        """The FlashInfer pool's ``which`` ("k"/"v") at ``slots`` (all if None), dequantized to the model dtype."""
        pool = self.fi_pool
        rows = getattr(pool, f"{which}_caches")[layer].view(-1, pool.num_kv_heads, pool.head_dim)
        if slots is not None:
            rows = rows.view(torch.uint8)[slots].view(rows.dtype)  # as bytes: no fp8 indexing on the CPU
        if not pool.is_quantized:
            return rows
        scales = getattr(pool, f"{which}_scales")[layer].view(-1, pool.num_kv_heads)
        scales = scales if slots is None else scales[slots]
        if slots is not None:  # the one scale FlashInfer is told, for every token it reads
            assert (scales == FP8_KV_SCALE).all()
        return dequantize_kv(rows, scales, pool.dtype)

    def cached_prefix(self, seq: int, n: int) -> None:
        """``n`` tokens of ``seq`` already in both pools (a prefix-cache hit), the reference's dequantized."""
        self._grow(seq, n)
        slots = self._slots(seq, 0, n)
        for layer in range(self.fi_pool.num_layers):
            for which in ("k", "v"):
                values = self._randn(n, self.heads[1], self.head_dim)
                fi_rows = getattr(self.fi_pool, f"{which}_caches")[layer].view(-1, self.heads[1], self.head_dim)
                if self.fi_pool.is_quantized:  # stored as FlashInfer's writes are: value / scale, scale per token
                    fp8 = (values.float() / FP8_KV_SCALE).to(fi_rows.dtype)
                    fi_rows.view(torch.uint8)[slots] = fp8.view(torch.uint8)
                    getattr(self.fi_pool, f"{which}_scales")[layer].view(-1, self.heads[1])[slots] = FP8_KV_SCALE
                else:
                    fi_rows[slots] = values
                ref_rows = getattr(self.ref_pool, f"{which}_caches")[layer].view(-1, self.heads[1], self.head_dim)
                ref_rows[slots] = self._stored(which, layer, slots)
        self.lengths[seq] = n

    def shared_prefix(self, seq: int, donor: int) -> None:
        """A new ``seq`` whose table starts with ``donor``'s full pages (a hit on a live sequence's pages)."""
        full = self.lengths[donor] // self.page_size
        assert full >= 1, "the donor holds no full page to share"
        self.pages[seq] = list(self.pages[donor][:full])
        self.lengths[seq] = full * self.page_size

    def step(self, work: list[tuple[int, int]]) -> None:
        """One engine step of (seq, new tokens); both backends must agree on every layer."""
        ctxs = [self.lengths.get(s, 0) + n for s, n in work]
        for (s, _), c in zip(work, ctxs, strict=True):
            self._grow(s, c)
            self.lengths[s] = c
        layout = StepLayout([n for _, n in work], ctxs, [list(self.pages[s]) for s, _ in work])
        slots = torch.cat([self._slots(s, c - n, c) for (s, n), c in zip(work, ctxs, strict=True)])
        total = sum(n for _, n in work)
        decode_only = all(n == 1 for _, n in work)
        rows = total  # what the FlashInfer backend is handed: the step's tokens, and padding rows on the static path
        static = decode_only and bool(self.static_sizes) and total <= self.static_sizes[-1]
        if static:
            rows = min(size for size in self.static_sizes if size >= total)
        wrapper = self.fi.static_decode[rows] if static else self.fi.decode if decode_only else self.fi.prefill
        counts = (getattr(wrapper, "num_plans", 0), getattr(wrapper, "num_runs", 0))  # the emulator's
        if static:
            self.fi.plan_static_decode(rows, layout)
            self.static_steps += 1
        else:
            self.fi.plan(layout)
        self.ref.plan(layout)
        for layer in range(self.fi_pool.num_layers):
            # q as a strided slice, as the fused qkv projection hands it over.
            q = self._randn(rows, self.heads[0] + 1, self.head_dim)[:, : self.heads[0]]
            k, v = self._randn(rows, self.heads[1], self.head_dim), self._randn(rows, self.heads[1], self.head_dim)
            got = self.fi.forward(layer, q, k, v)[:total]  # first: it writes the pages the reference is given
            q, k, v = q[:total], k[:total], v[:total]
            kept_k, kept_v = self._stored("k", layer, slots), self._stored("v", layer, slots)
            for true, kept in ((k, kept_k), (v, kept_v)):
                if self.fi_pool.is_quantized:  # e4m3's rounding: 3 mantissa bits, subnormals down to 2^-9
                    assert ((true.float() - kept.float()).abs() <= true.float().abs() / 16 + 1 / 1024).all()
                else:
                    assert torch.equal(true, kept)
            want = self.ref.forward(layer, q, kept_k, kept_v)
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
        for work in chunked_prefill(prompts, 24):
            self.step(work)
        for _ in range(3):
            self.step([(s, 1) for s in prompts])  # decode-only
        self.step([(0, 1), (9, 33), (2, 1)])  # a new prompt among decodes
        # A prompt whose first pages are the longest sequence's, read by both in one step.
        donor = max(prompts, key=lambda s: self.lengths[s])
        self.shared_prefix(10, donor)
        self.step([(10, 7), (9, 1), (donor, 1)])

    def assert_same_pages(self) -> None:
        """Both backends wrote the same k/v at the same slots (the FlashInfer pool's dequantized)."""
        for layer in range(self.fi_pool.num_layers):
            real = self.ref_pool.num_pages * self.page_size  # the pad page, if any, lies past these slots
            assert torch.equal(self.ref_pool.k_caches[layer].flatten(0, 1), self._stored("k", layer)[:real])
            assert torch.equal(self.ref_pool.v_caches[layer].flatten(0, 1), self._stored("v", layer)[:real])


HEADS = [(8, 2), (6, 2), (8, 1), (4, 4)]  # GQA 4 (tensor-core decode), GQA 3, MQA, MHA
HEAD_IDS = [f"{h}q{k}kv" for h, k in HEADS]


def _check(pair: Pair, request: pytest.FixtureRequest) -> None:
    """Run the workload; its worst difference within tolerance, printed (``-s``) and in the junit XML."""
    pair.run_workload()
    request.node.user_properties.append(("max_abs_diff", pair.worst))
    print(f"{request.node.name}: max |flashinfer - torch| = {pair.worst:.3g}")
    assert pair.worst <= TOLERANCE[pair.dtype], pair.worst
    pair.assert_same_pages()


def _check_emulated(pair: Pair, request: pytest.FixtureRequest) -> None:
    """``_check``, and the wrappers' construction as the emulator recorded it."""
    _check(pair, request)
    heads = pair.heads
    assert pair.fi.decode.use_tensor_cores == (heads[0] // heads[1] >= 4)  # type: ignore[attr-defined]
    assert pair.fi.prefill.float_workspace_buffer is pair.fi.decode.float_workspace_buffer  # type: ignore[attr-defined]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
def test_matches_torch_paged_attention(heads: tuple[int, int], page_size: int, dtype: torch.dtype,
                                       request: pytest.FixtureRequest) -> None:  # fmt: skip
    _check_emulated(Pair(heads, page_size, dtype, seed=page_size + heads[0] * 7 + heads[1]), request)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("heads", HEADS[::2], ids=HEAD_IDS[::2])
def test_fp8_pages_match_their_dequantized_reference(heads: tuple[int, int], page_size: int, dtype: torch.dtype,
                                                     request: pytest.FixtureRequest) -> None:  # fmt: skip
    pair = Pair(heads, page_size, dtype, seed=3 * page_size + heads[1], kv_dtype="fp8_e4m3")
    _check_emulated(pair, request)
    assert pair.fi_pool.k_caches[0].dtype == torch.float8_e4m3fn


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", HEADS[::2], ids=HEAD_IDS[::2])
def test_static_decode_matches_torch_paged_attention(heads: tuple[int, int], dtype: torch.dtype, kv_dtype: str,
                                                     request: pytest.FixtureRequest) -> None:  # fmt: skip
    """Decode-only steps padded to sizes 2 and 8 (the workload's 6 and 3 sequences pad to 8) on the static buffers."""
    pair = Pair(heads, 16, dtype, seed=5 + heads[1], kv_dtype=kv_dtype, static_sizes=(2, 8))
    _check_emulated(pair, request)
    assert pair.static_steps >= 3
    assert all(w.is_cuda_graph_enabled for w in pair.fi.static_decode.values())  # type: ignore[attr-defined]


def test_static_decode_reads_the_page_table_from_its_buffers() -> None:
    """What a replayed graph sees: the buffers as the latest plan of that size left them."""
    pair = Pair((8, 2), 16, torch.float32, seed=11, static_sizes=(4,))
    pair.step([(0, 9), (1, 20), (2, 3)])
    wrapper = pair.fi.static_decode[4]
    pair.step([(0, 1), (1, 1), (2, 1)])  # planned and run on size 4's buffers
    q = torch.randn(4, 8, HEAD_DIM)
    planned = wrapper.run(q, pair.fi._caches[0])  # type: ignore[attr-defined]
    buffers = wrapper._buffers  # type: ignore[attr-defined]
    buffers[1][: buffers[0][-1]] = buffers[1][: buffers[0][-1]].flip(0)  # another page order, as a new plan would write
    assert not torch.equal(wrapper.run(q, pair.fi._caches[0]), planned)  # type: ignore[attr-defined]
    with pytest.raises(AssertionError, match=r"\(5, 4\)"):  # more sequences than the size holds
        pair.fi.plan_static_decode(4, StepLayout([1] * 5, [3] * 5, [[0]] * 5))
    with pytest.raises(ValueError, match="batch size should be fixed"):
        wrapper.plan(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),  # type: ignore[attr-defined]
                     torch.tensor([1], dtype=torch.int32), 8, 2, HEAD_DIM, 16, q_data_type=torch.float32)  # fmt: skip


def test_static_decode_needs_a_pad_page_and_known_sizes() -> None:
    pool = _pool((8, 2), 16, torch.float32)
    with pytest.raises(ValueError, match="pad page"):
        _flashinfer(pool, (8, 2), flashinfer_emulator).enable_static_decode([1, 2], 4)
    padded = _pool((8, 2), 16, torch.float32, pad_page=True)
    assert padded.pad_page_id == padded.num_pages == 160 and padded.k_caches[0].shape[0] == 161
    backend = _flashinfer(padded, (8, 2), flashinfer_emulator)
    backend.enable_static_decode([1, 2], 4)
    with pytest.raises(AssertionError, match="no static decode of batch size 3"):
        backend.plan_static_decode(3, StepLayout([1], [5], [[0]]))
    with pytest.raises(AssertionError, match="max_pages_per_seq"):
        backend.plan_static_decode(2, StepLayout([1], [65], [list(range(5))]))
    with pytest.raises(KVPayloadMismatchError, match="page ids"):
        padded.read_pages([160])  # the pad page is nobody's: it does not travel


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


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and flashinfer_installed()), reason="needs CUDA and flashinfer")
@pytest.mark.parametrize("static_sizes", [(), (2, 8)], ids=["dynamic", "static_decode"])
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("heads", [(8, 2), (8, 1)], ids=["gqa4", "mqa"])
def test_real_flashinfer_matches_torch_paged_attention_on_cuda(heads: tuple[int, int], kv_dtype: str,
                                                               static_sizes: tuple[int, ...],
                                                               request: pytest.FixtureRequest) -> None:  # fmt: skip
    """``static_decode``: decode steps on FlashInfer's use_cuda_graph wrappers (run eagerly; the engine's gpu test captures)."""
    # head_dim 128: a size every FlashInfer build has kernels for.
    pair = Pair(heads, 16, torch.bfloat16, seed=1, kernels=load_flashinfer(), device="cuda", head_dim=128,
                kv_dtype=kv_dtype, static_sizes=static_sizes)  # fmt: skip
    _check(pair, request)
    assert pair.static_steps >= (3 if static_sizes else 0)
