"""The engine against Hugging Face transformers, token for token, in every scheduling mode.

Models: two seeded tiny checkpoints (Llama with GQA, Qwen2 with biases, MQA
and tied embeddings) and the embedded ``tiny`` preset (``LLM("tiny")``'s
weights). Every mode runs on each attention backend in ``BACKENDS``: the
torch reference, FlashInfer's backend under the tests' CPU emulator of its
kernels, and that backend with ``cuda_graphs`` on: decode steps on the
static buffers a CUDA graph replays (run eagerly on the CPU).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from actors.load.embedded import build_tokenizer
from apps.llm import LLM
from kvcache.attention.flashinfer import FlashInferPagedAttention
from kvcache.attention.torch_paged import TorchPagedAttention
from scheduling.sampling_params import SamplingParams
from tests.actors.checkpoints import (
    build_hf_model,
    hf_greedy,
    llama_config,
    qwen2_config,
    write_checkpoint,
)
from tests.kvcache import flashinfer_emulator

MAX_TOKENS = 12
CONFIGS = {"llama_gqa": (llama_config, 0), "qwen2_bias_tied": (qwen2_config, 1)}
EMBEDDED = "tiny"  # the embedded preset, beside the seeded CONFIGS

MODES: dict[str, dict[str, Any]] = {
    "prefix_on": {},
    "prefix_off": {"enable_prefix_caching": False},
    "chunked_small_budget": {"max_num_batched_tokens": 16, "max_num_seqs": 16},
    "preemption": {"num_kv_pages": 40, "page_size": 4},
    "batch_1": {"max_num_seqs": 1},
}

# The attention backends every mode runs on, as EngineConfig overrides.
BACKENDS: dict[str, dict[str, object]] = {
    "torch": {},
    "flashinfer_emulator": {"attention_backend": "flashinfer", "attention_kernels": flashinfer_emulator},
    "flashinfer_static_decode": {"attention_backend": "flashinfer", "attention_kernels": flashinfer_emulator,
                                 "cuda_graphs": True},
}


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    shared = [[rng.randrange(3, 256) for _ in range(rng.randint(20, 40))] for _ in range(3)]
    prompts = []
    for i in range(16):
        body = [rng.randrange(3, 256) for _ in range(rng.randint(1, 60))]
        prompts.append(shared[i % 3] + body if i % 4 else body)
    return prompts


PROMPTS = _prompts()
# The small-budget mode must really split prompts: most are longer than 16 tokens.
assert sum(len(p) > 16 for p in PROMPTS) >= 8


@pytest.fixture(scope="module", params=[*CONFIGS, EMBEDDED])
def model_case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]], Any]:
    if request.param == EMBEDDED:
        folder = request.getfixturevalue("tiny_dir")
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    else:
        make_config, seed = CONFIGS[request.param]
        folder = write_checkpoint(tmp_path_factory.mktemp(request.param), make_config(), seed=seed)
        build_tokenizer().save_pretrained(folder)
        hf = build_hf_model(make_config(), seed)
    expected = [hf_greedy(hf, p, MAX_TOKENS) for p in PROMPTS]
    return folder, expected, hf


def _engine(folder: Path, **overrides: Any) -> LLM:
    kw: dict[str, Any] = {"max_model_len": 128, "max_num_seqs": 16, "max_num_batched_tokens": 512,
                          "dtype": "float32", "device": "cpu"}
    kw.update(overrides)
    return LLM(str(folder), **kw)


def assert_backend(llm: LLM, backend: str) -> None:
    """The engine attends with the backend ``backend`` names (nothing fell back to another)."""
    runner = llm.engine.executor.runner  # type: ignore[attr-defined]
    want = TorchPagedAttention if backend == "torch" else FlashInferPagedAttention
    assert type(runner.attn) is want
    assert (runner.graphs is not None) == (backend == "flashinfer_static_decode")


def assert_decode_path(llm: LLM) -> None:
    """After a generate: an engine with static-buffer decode (``assert_backend``) ran its decode steps there."""
    graphs = llm.engine.executor.runner.graphs  # type: ignore[attr-defined]
    assert graphs is None or graphs.replays > 0


def assert_pool_clean(llm: LLM) -> None:
    """Every KV page is free once the prefix cache lets go of its (unlocked) pages."""
    sched = llm.engine.policy
    alloc = sched.allocator
    alloc.check_integrity()
    cached = sched.cache.num_cached_pages if sched.cache is not None else 0
    assert alloc.num_free_pages + cached == alloc.num_pages
    if sched.cache is not None:
        assert sched.cache.num_locked_pages == 0
        sched.cache.reset()
    assert alloc.num_free_pages == alloc.num_pages


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_matches_hf(model_case: tuple[Path, list[list[int]], Any], mode: str, backend: str) -> None:
    folder, expected, _ = model_case
    llm = _engine(folder, **MODES[mode], **BACKENDS[backend])
    assert_backend(llm, backend)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == expected
    assert_decode_path(llm)
    stats = llm.engine.policy.stats
    if mode == "preemption":
        assert stats.num_preemptions > 0
    if mode == "prefix_on":
        # A second pass finds every shared prefix (and most prompts) in the cache.
        again = llm.generate(PROMPTS, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == expected
        assert sum(o.num_cached_tokens for o in again) > 0
    assert_pool_clean(llm)


def test_first_token_top20_logprobs_match_hf(model_case: tuple[Path, list[list[int]], Any]) -> None:
    folder, _, hf = model_case
    llm = _engine(folder)
    outs = llm.generate(PROMPTS[:4], SamplingParams(max_tokens=1, temperature=0.0, logprobs=20), use_tqdm=False)
    for prompt, out in zip(PROMPTS[:4], outs, strict=True):
        with torch.inference_mode():
            ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1].float(), dim=-1)
        top = torch.topk(ref, 20)
        lp = out.outputs[0].logprobs
        assert lp is not None and len(lp) == 1
        assert lp[0].top_token_ids == top.indices.tolist()
        assert torch.allclose(torch.tensor(lp[0].top_logprobs), top.values, atol=1e-4)
        assert abs(lp[0].logprob - float(ref[out.outputs[0].token_ids[0]])) < 1e-4
    assert_pool_clean(llm)
