"""Static-buffer decode (``cuda_graphs``): the sizes, the refusals, and the same tokens as the dynamic path.

On the CPU the static path runs eagerly over the buffers a CUDA graph would
replay (FlashInfer's backend under the tests' emulator); the oracles
(test_engine_oracle.py, test_smollm2_oracle.py) check it against
transformers, and this file against the engine's own dynamic path, sampled
requests included. The ``gpu`` test captures the graphs on CUDA.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from actors.config import EngineConfig
from actors.load.embedded import ensure_embedded_model
from actors.models.moe import MoEArgs, SparseMoE, grouped_mm_on_device
from actors.runner.decode_graphs import (
    GRAPH_SIZE_STEP,
    DecodeGraphs,
    graph_batch_sizes,
    moe_graphs_allowed,
)
from apps.llm import LLM
from kvcache.attention.flashinfer import flashinfer_installed
from kvcache.attention.torch_paged import TorchPagedAttention
from kvcache.kv_pool import KVPool
from scheduling.errors import InvalidParameterError
from scheduling.sampling_params import SamplingParams
from tests.actors.engine.test_engine_oracle import assert_pool_clean
from tests.kvcache import flashinfer_emulator

EMULATED: dict[str, Any] = {"attention_backend": "flashinfer", "attention_kernels": flashinfer_emulator}


@pytest.mark.parametrize(
    ("max_num_seqs", "sizes"),
    [(1, [1]), (3, [1, 2, 3]), (16, [1, 2, 4, 8, 16]), (40, [1, 2, 4, 8, 16, 32, 40]),
     (64, [1, 2, 4, 8, 16, 32, 64]), (100, [1, 2, 4, 8, 16, 32, 64, 96, 100])],
)  # fmt: skip
def test_graph_batch_sizes(max_num_seqs: int, sizes: list[int]) -> None:
    assert GRAPH_SIZE_STEP == 32
    assert graph_batch_sizes(max_num_seqs) == sizes


def test_cuda_graphs_default_and_refusals() -> None:
    assert EngineConfig(device="cpu").resolved_cuda_graphs() is False
    assert EngineConfig(device="cpu", **EMULATED).resolved_cuda_graphs() is False  # on only where asked
    assert EngineConfig(device="cpu", cuda_graphs=True, **EMULATED).resolved_cuda_graphs() is True
    cases: list[tuple[dict[str, Any], str]] = [
        ({"device": "cpu", "cuda_graphs": True}, "CUDA device, and the device is cpu"),
        ({"device": "cuda", "cuda_graphs": True}, "attention_backend='flashinfer', not 'auto'"),
        ({"device": "cuda", "cuda_graphs": True, "attention_backend": "torch"}, "not 'torch'"),
        ({"device": "cpu", "cuda_graphs": "yes"}, "must be true, false or None"),
    ]
    if flashinfer_installed():  # else attention_backend='flashinfer' on CUDA is refused first
        cases.append(({"device": "cuda", "cuda_graphs": True, "attention_backend": "flashinfer",
                       "executor": "ray", "tensor_parallel_size": 2}, "tensor_parallel_size 2"))  # fmt: skip
    for kwargs, words in cases:
        with pytest.raises(InvalidParameterError) as err:
            EngineConfig(**kwargs)
        assert err.value.param == "cuda_graphs" and words in err.value.message, (kwargs, err.value.message)
    assert EngineConfig(device="cpu", cuda_graphs=False).resolved_cuda_graphs() is False


def test_static_decode_needs_a_capable_backend_and_capture_needs_cuda() -> None:
    pool = KVPool(num_layers=1, num_pages=4, page_size=4, num_kv_heads=1, head_dim=8, dtype=torch.float32,
                  pad_page=True)  # fmt: skip
    torch_backend = TorchPagedAttention(pool, num_heads=2, num_kv_heads=1, head_dim=8)
    with pytest.raises(ValueError, match="TorchPagedAttention has no static-shape decode"):
        DecodeGraphs(lambda i, p, a: i, torch_backend, max_num_seqs=2, max_pages_per_seq=2,
                     device=torch.device("cpu"), capture=False)  # fmt: skip
    with pytest.raises(NotImplementedError):
        torch_backend.enable_static_decode([1], 2)


@pytest.mark.parametrize(("dtype", "capability", "on_device"), [
    (torch.bfloat16, (9, 0), True), (torch.bfloat16, (10, 0), True),
    (torch.bfloat16, (8, 0), False), (torch.bfloat16, (12, 0), False), (torch.bfloat16, None, False),
    (torch.float16, (9, 0), False), (torch.float32, (10, 0), False),
])  # fmt: skip
def test_grouped_mm_runs_its_capturable_device_kernel_only_for_bf16_on_sm90_and_sm100(
        dtype: torch.dtype, capability: tuple[int, int] | None, on_device: bool) -> None:
    assert grouped_mm_on_device(dtype, capability) is on_device


def _moe(dtype: torch.dtype, hidden: int = 64, inter: int = 32) -> SparseMoE:
    return SparseMoE(hidden, MoEArgs(num_experts=4, top_k=2, intermediate_size=inter, renormalize=True)).to(dtype)


def test_moe_graphs_where_grouped_mm_would_sync_are_refused_by_name_or_left_off() -> None:
    """Asked for (cuda_graphs=True): refused naming cuda_graphs; only the default: decode runs eagerly."""
    assert moe_graphs_allowed([_moe(torch.bfloat16)], (9, 0), asked=True)
    assert moe_graphs_allowed([], (8, 0), asked=True)  # a dense model captures anywhere
    host_loops = [([_moe(torch.float16)], (9, 0), "host-copying loop for float16 on sm90"),
                  ([_moe(torch.bfloat16)], (8, 6), "host-copying loop for bfloat16 on sm86"),
                  ([_moe(torch.bfloat16, inter=36)], (10, 0), "expert sizes [36]")]  # 72-byte rows
    for blocks, capability, words in host_loops:
        with pytest.raises(InvalidParameterError) as err:
            moe_graphs_allowed(blocks, capability, asked=True)
        assert err.value.param == "cuda_graphs" and words in err.value.message, err.value.message
        assert not moe_graphs_allowed(blocks, capability, asked=False)


def _prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(rng.randint(2, 70))] for _ in range(n)]


def _engine(model: Path, cuda_graphs: bool, **overrides: Any) -> LLM:
    kw: dict[str, Any] = {"max_model_len": 256, "max_num_seqs": 12, "max_num_batched_tokens": 96, "dtype": "float32",
                          "device": "cpu", "cuda_graphs": cuda_graphs, **EMULATED, **overrides}  # fmt: skip
    return LLM(str(model), **kw)


def _generate(llm: LLM) -> list[list[int]]:
    """Greedy and seeded sampled requests, finishing at different lengths, so decode batch sizes shrink step by step.

    The first prompt (pages 0.. of a fresh pool) runs longest: a padding row
    writing anywhere but the pad page would hit a live sequence.
    """
    prompts = _prompts(5, 20)
    params = [SamplingParams(max_tokens=4 + 3 * ((20 - i) % 7), ignore_eos=True,
                             **({"temperature": 0.0} if i % 2 else {"temperature": 0.9, "top_p": 0.9, "seed": i}))
              for i in range(len(prompts))]  # fmt: skip
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_embedded_model("tiny", root=tmp_path_factory.mktemp("cache"))


@pytest.mark.parametrize("overrides", [{}, {"num_kv_pages": 40, "page_size": 8}], ids=["roomy", "preempting"])
def test_static_decode_gives_the_dynamic_paths_tokens(tiny: Path, overrides: dict[str, Any]) -> None:
    plain, llm = _engine(tiny, False, **overrides), _engine(tiny, True, **overrides)
    assert _generate(llm) == _generate(plain)
    graphs = llm.engine.executor.runner.graphs  # type: ignore[attr-defined]
    assert graphs is not None and graphs.sizes == [1, 2, 4, 8, 12] and not graphs.captured
    assert graphs.replays > 0 and plain.engine.executor.runner.graphs is None  # type: ignore[attr-defined]
    if overrides:
        assert llm.engine.policy.stats.num_preemptions > 0
    for engine in (plain, llm):
        assert_pool_clean(engine)


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and flashinfer_installed()), reason="needs CUDA and flashinfer")
def test_captured_graphs_replay_the_eager_static_path(tiny: Path) -> None:
    """On CUDA: the captured graphs give the tokens their own static buffers give when run eagerly.

    Both run the same padded shapes, so the same kernels and the same
    tokens; against the dynamic path (other shapes, other bf16 rounding)
    greedy picks may part at near-ties, which the oracles' HF comparison
    (float32, CPU) and the device report's greedy agreement cover instead.
    """
    llm = _engine(tiny, True, device="cuda", dtype="bfloat16", attention_kernels=None)
    graphs = llm.engine.executor.runner.graphs  # type: ignore[attr-defined]
    assert graphs is not None and graphs.captured
    replayed = _generate(llm)
    assert graphs.replays > 0
    graphs._graphs.clear()  # the same engine and buffers, every size now run eagerly
    assert _generate(llm) == replayed
    assert_pool_clean(llm)
