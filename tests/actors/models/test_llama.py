"""Our Llama-family implementation against Hugging Face transformers as the oracle."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from actors.load.loader import load_model
from actors.models.layers import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    rope_inv_freq,
)
from actors.models.llama import LlamaForCausalLM, llama_args
from actors.models.registry import (
    SUPPORTED_ARCHITECTURES,
    UnsupportedModelError,
    resolve_architecture,
)
from scheduling.errors import InvalidParameterError
from tests.actors.checkpoints import (
    LLAMA3_ROPE,
    greedy,
    hf_greedy,
    hf_logits,
    mistral_config,
    new_dense,
    prefill_then_decode,
    step_logits,
)

ARCHS = ["llama", "llama3_rope", "qwen2", "mistral"]
ATOL = 1e-4
PROMPTS = [[1, 5, 9, 200, 33, 7], [1, 400, 401, 402, 3, 3, 3, 90, 12, 511, 0], [1, 77]]


def _pair(dirs: dict[str, Path], arch: str) -> tuple[LlamaForCausalLM, PreTrainedModel]:
    ours = load_model(str(dirs[arch]), dtype=torch.float32, device="cpu", max_model_len=128).model
    hf = AutoModelForCausalLM.from_pretrained(dirs[arch], dtype=torch.float32, attn_implementation="eager")
    return ours, hf.eval()


@pytest.fixture(scope="module", params=ARCHS)
def pair(request: pytest.FixtureRequest, checkpoint_dirs: dict[str, Path]) -> tuple[Any, Any]:
    return _pair(checkpoint_dirs, request.param)


def _prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_whole_prompt_logits_match_hf(pair: tuple[Any, Any]) -> None:
    ours, hf = pair
    tokens = _prompt(60)
    got = step_logits(ours, new_dense(ours), [(0, tokens, 0)])[0]
    assert got.dtype == torch.float32 and got.shape == (60, 512)
    torch.testing.assert_close(got, hf_logits(hf, tokens), atol=ATOL, rtol=0)


def test_prefill_then_decode_matches_hf(pair: tuple[Any, Any]) -> None:
    ours, hf = pair
    tokens = _prompt(48, seed=1)  # decode runs past llama3's original 32-token context
    got = prefill_then_decode(ours, new_dense(ours), tokens, prefix=20)
    torch.testing.assert_close(got, hf_logits(hf, tokens), atol=ATOL, rtol=0)


def test_mixed_step_of_several_sequences_matches_hf(pair: tuple[Any, Any]) -> None:
    """One flattened step holding a decode, a prompt chunk and a whole prompt."""
    ours, hf = pair
    a, b, c = _prompt(10, 2), _prompt(17, 3), _prompt(9, 4)
    attn = new_dense(ours)
    step_logits(ours, attn, [(0, a[:9], 0), (1, b[:5], 0)])
    got = step_logits(ours, attn, [(0, a[9:], 9), (1, b[5:], 5), (2, c, 0)])
    for logits, tokens, num_new in zip(got, (a, b, c), (1, 12, 9), strict=True):
        torch.testing.assert_close(logits, hf_logits(hf, tokens)[-num_new:], atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_greedy_continuation_equals_hf_generate(checkpoint_dirs: dict[str, Path], arch: str) -> None:
    ours, hf = _pair(checkpoint_dirs, arch)
    for prompt in PROMPTS:
        assert greedy(ours, new_dense(ours), prompt, 16) == hf_greedy(hf, prompt, 16)


def test_torch_paged_attention_backend_matches_hf(checkpoint_dirs: dict[str, Path]) -> None:
    """The real paged backend, page size 4, two sequences interleaved in the pool."""
    from kvcache.attention.backend import StepLayout
    from kvcache.attention.torch_paged import TorchPagedAttention
    from kvcache.kv_pool import KVPool

    ours, hf = _pair(checkpoint_dirs, "llama")
    pool = KVPool(num_layers=ours.num_layers, num_pages=32, page_size=4, num_kv_heads=ours.num_kv_heads,
                  head_dim=ours.head_dim, dtype=torch.float32)  # fmt: skip
    attn = TorchPagedAttention(pool, num_heads=ours.num_heads, num_kv_heads=ours.num_kv_heads,
                               head_dim=ours.head_dim, scale=ours.scale)  # fmt: skip
    a, b = _prompt(13, 5), _prompt(6, 6)
    pages = {0: [3, 9, 1, 30, 7], 1: [2, 4, 31]}  # scattered on purpose
    rows: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    done = {0: 0, 1: 0}
    chunks = [{0: 7, 1: 6}, {0: 3, 1: 1}, {0: 1, 1: 1}, {0: 2, 1: 1}]  # prefill chunks, then decode
    extra = {1: [17, 300, 2]}  # b's continuation tokens
    seqs = {0: a, 1: b + extra[1]}
    for chunk in chunks:
        ids, pos, qlens, ctxs, tables = [], [], [], [], []
        for s, n in chunk.items():
            toks = seqs[s][done[s] : done[s] + n]
            ids += toks
            pos += list(range(done[s], done[s] + n))
            done[s] += n
            qlens.append(n)
            ctxs.append(done[s])
            tables.append(pages[s])
        attn.plan(StepLayout(query_lens=qlens, context_lens=ctxs, page_tables=tables))
        with torch.inference_mode():
            logits = ours.compute_logits(ours(torch.tensor(ids), torch.tensor(pos), attn))
        for s, part in zip(chunk, logits.split(qlens), strict=True):
            rows[s].append(part)
    for s in (0, 1):
        torch.testing.assert_close(torch.cat(rows[s]), hf_logits(hf, seqs[s]), atol=ATOL, rtol=0)


def test_llama3_inv_freq_matches_hf() -> None:
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, rope_parameters=dict(LLAMA3_ROPE))
    expected, factor = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    got = rope_inv_freq(16, LLAMA3_ROPE["rope_theta"], LLAMA3_ROPE)
    assert factor == 1.0
    torch.testing.assert_close(got, expected, atol=0, rtol=1e-6)
    assert not torch.allclose(got, rope_inv_freq(16, LLAMA3_ROPE["rope_theta"], None))


def test_unsupported_rope_type_is_a_clear_error() -> None:
    with pytest.raises(InvalidParameterError, match="'yarn'.*llama3") as err:
        rope_inv_freq(16, 10000.0, {"rope_type": "yarn", "factor": 4.0})
    assert err.value.param == "model"


def test_transformers4_config_dict_reads_like_transformers5_config() -> None:
    v5 = LlamaConfig(hidden_size=64, num_attention_heads=4, rope_parameters=dict(LLAMA3_ROPE))
    scaling = {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}
    v4 = {**v5.to_dict(), "rope_theta": LLAMA3_ROPE["rope_theta"], "rope_scaling": scaling}
    del v4["rope_parameters"]
    assert llama_args(v4) == llama_args(v5)
    assert llama_args(v5).rope.theta == 50000.0


def test_mistral_sliding_window_is_every_layers_window() -> None:
    # The backend applies it, so max_model_len is no longer bounded by the window.
    model = LlamaForCausalLM(mistral_config(sliding_window=128), max_model_len=256)
    assert model.sliding_windows == (128, 128)
    assert LlamaForCausalLM(mistral_config(sliding_window=None), max_model_len=256).sliding_windows == (None, None)


def test_unsupported_architecture_names_the_supported_ones() -> None:
    with pytest.raises(UnsupportedModelError) as err:
        resolve_architecture({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    assert err.value.param == "model" and isinstance(err.value, ValueError)
    for name in ("GPT2LMHeadModel", *SUPPORTED_ARCHITECTURES):
        assert name in str(err.value)
    assert resolve_architecture({"model_type": "qwen2"}) is LlamaForCausalLM


def test_tensor_parallel_shards_reassemble_the_full_weights() -> None:
    """Every rank's slice, concatenated, is the HF tensor; KV heads replicate when scarce."""
    g = torch.Generator().manual_seed(0)
    head_dim, heads, kv_heads, hidden = 4, 8, 2, 16
    q, k, v = (torch.randn(n * head_dim, hidden, generator=g) for n in (heads, kv_heads, kv_heads))
    for tp in (1, 2, 4):  # tp 4 > 2 KV heads: each KV head lives on two ranks
        for rank in range(tp):
            layer = QKVParallelLinear(hidden, head_dim, heads, kv_heads, tp_rank=rank, tp_size=tp)
            for sid, t in zip("qkv", (q, k, v), strict=True):
                layer.load_weight("weight", t, sid)
            per, first = (kv_heads // tp, rank * kv_heads // tp) if kv_heads >= tp else (1, rank // (tp // kv_heads))
            nq, kv_rows = heads // tp * head_dim, slice(first * head_dim, (first + per) * head_dim)
            expected = torch.cat([q[rank * nq : (rank + 1) * nq], k[kv_rows], v[kv_rows]])
            assert layer.num_kv_heads == per and torch.equal(layer.weight, expected)
    with pytest.raises(InvalidParameterError, match="tensor_parallel_size"):
        QKVParallelLinear(hidden, head_dim, heads, 3, tp_size=2)
    gate, up, down = torch.randn(12, 6), torch.randn(12, 6), torch.randn(6, 12)
    merged = [MergedColumnParallelLinear(6, [12, 12], tp_rank=r, tp_size=2) for r in range(2)]
    rows = [RowParallelLinear(12, 6, tp_rank=r, tp_size=2) for r in range(2)]
    for r in range(2):
        merged[r].load_weight("weight", gate, 0)
        merged[r].load_weight("weight", up, 1)
        rows[r].load_weight("weight", down)
    assert torch.equal(torch.cat([m.weight[:6] for m in merged]), gate)
    assert torch.equal(torch.cat([m.weight[6:] for m in merged]), up)
    assert torch.equal(torch.cat([r.weight for r in rows], dim=1), down)
    emb = torch.randn(7, 3)  # 7 rows over 2 ranks: rank 1 has a zero padding row
    parts = [VocabParallelEmbedding(7, 3, tp_rank=r, tp_size=2) for r in range(2)]
    for p in parts:
        p.load_weight("weight", emb)
    assert torch.equal(torch.cat([p.weight for p in parts])[:7], emb)
    assert not parts[1].weight[-1].any()
