"""Seeded tiny Hugging Face checkpoints and a dense reference attention, for tests.

Importable from any test folder (``from tests.actors.checkpoints import ...``).
Every builder writes a real ``save_pretrained`` folder whose weights are
drawn from a seeded generator, with std large enough that attention is far
from uniform (so a RoPE or masking mistake changes the logits visibly) and
with random biases and norm weights (HF initialises those to 0/1, which
would hide a dropped bias).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Phi3Config,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

from actors.load.embedded import build_tokenizer
from kvcache.attention.backend import AttentionBackend, StepLayout

_COMMON: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

LLAMA3_ROPE: dict[str, Any] = {
    "rope_type": "llama3",
    "rope_theta": 50000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


def llama_config(**overrides: Any) -> LlamaConfig:
    """Tiny Llama with GQA (4 query heads, 2 KV heads)."""
    kw = {**_COMMON, "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False}
    return LlamaConfig(**{**kw, **overrides})


def llama3_config() -> LlamaConfig:
    """Tiny Llama with llama3 rope scaling, attention and MLP biases."""
    return llama_config(rope_parameters=dict(LLAMA3_ROPE), attention_bias=True, mlp_bias=True)


def qwen2_config() -> Qwen2Config:
    """Tiny Qwen2: q/k/v bias, MQA (1 KV head), tied embeddings."""
    kw = {**_COMMON, "num_attention_heads": 4, "num_key_value_heads": 1, "tie_word_embeddings": True}
    return Qwen2Config(**kw, rope_parameters={"rope_type": "default", "rope_theta": 1e6})


def mistral_config(sliding_window: int | None = 128) -> MistralConfig:
    """Tiny Mistral with an explicit head_dim (16 != 64 / 8) and a sliding window."""
    kw = {**_COMMON, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16}
    return MistralConfig(**kw, sliding_window=sliding_window, tie_word_embeddings=False)


# The 2026 families with every feature on: GQA (4 query heads, 2 KV heads), a
# sliding window (WINDOW) shorter than most test prompts and not page
# aligned, q/k norms where the family has them, 8 experts with top-2 routing.
WINDOW = 24
_FAMILY: dict[str, Any] = {**_COMMON, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                           "pad_token_id": 0, "tie_word_embeddings": False}
_MOE: dict[str, Any] = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}


def qwen3_config() -> Qwen3Config:
    """Qwen3: q/k norms, biases on all four projections, layer 0 global and layer 1 windowed."""
    return Qwen3Config(**_FAMILY, attention_bias=True, use_sliding_window=True, sliding_window=WINDOW,
                       max_window_layers=1, rope_parameters={"rope_type": "default", "rope_theta": 1e6})


def qwen3_moe_config() -> Qwen3MoeConfig:
    """Qwen3-MoE: layer 0 sparse (8 experts, top-2, renormalised), layer 1 dense (``mlp_only_layers``); windowed."""
    return Qwen3MoeConfig(**_FAMILY, **_MOE, norm_topk_prob=True, mlp_only_layers=[1],
                          use_sliding_window=True, sliding_window=WINDOW)


def qwen2_moe_config() -> Qwen2MoeConfig:
    """Qwen2-MoE: routed experts (not renormalised) plus a sigmoid-gated shared expert, q/k/v biases."""
    return Qwen2MoeConfig(**_FAMILY, **_MOE, shared_expert_intermediate_size=48, norm_topk_prob=False,
                          use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)


def mixtral_config() -> MixtralConfig:
    """Mixtral: every layer sparse (8 experts, top-2), a window on every layer."""
    return MixtralConfig(**_FAMILY, num_local_experts=8, num_experts_per_tok=2, sliding_window=WINDOW)


def gemma3_config() -> Gemma3TextConfig:
    """Gemma 3 text: layer 0 windowed with the local RoPE base, layer 1 global with linear RoPE scaling;
    a softmax scale from ``query_pre_attn_scalar`` (not head_dim) and a final logit soft cap."""
    rope = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    return Gemma3TextConfig(**{**_FAMILY, "tie_word_embeddings": True}, sliding_window=WINDOW,
                            layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=24,
                            rope_parameters=rope, final_logit_softcapping=30.0)


def phi3_config() -> Phi3Config:
    """Phi-3: fused qkv/gate_up in the checkpoint, a window on every layer."""
    return Phi3Config(**_FAMILY, sliding_window=WINDOW)


FAMILY_CONFIGS = {
    "qwen3": qwen3_config, "qwen3_moe": qwen3_moe_config, "qwen2_moe": qwen2_moe_config,
    "mixtral": mixtral_config, "gemma3": gemma3_config, "phi3": phi3_config,
}


def build_hf_model(config: PretrainedConfig, seed: int) -> PreTrainedModel:
    """An fp32 eager-attention HF model with seeded weights (the oracle)."""
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                std = 0.1 if name.endswith(".bias") else 1.0 / p.shape[-1] ** 0.5
                p.copy_(std * torch.randn(p.shape, generator=gen))
    return model.eval()


def write_checkpoint(
    folder: Path, config: PretrainedConfig, *, seed: int = 0, max_shard_size: str | None = None
) -> Path:
    """``save_pretrained`` a seeded model into ``folder`` (sharded when ``max_shard_size``)."""
    model = build_hf_model(config, seed)
    kwargs: dict[str, Any] = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(folder, **kwargs)
    return folder


def write_llama_with_tokenizer(folder: Path, seed: int = 0) -> Path:
    """The tiny seeded Llama (``llama_config()``) with the byte-level tokenizer: a folder an engine serves."""
    write_checkpoint(folder, llama_config(), seed=seed)
    build_tokenizer().save_pretrained(folder)
    return folder


class DenseAttention(AttentionBackend):
    """Reference backend: per-sequence K/V kept in Python lists, plain softmax attention.

    A sequence is identified by the first page of its page table (tests give
    each sequence its own), so several sequences may share one step.
    """

    def __init__(self, num_layers: int, scale: float) -> None:
        self.scale = scale
        self.k: list[dict[int, torch.Tensor]] = [{} for _ in range(num_layers)]
        self.v: list[dict[int, torch.Tensor]] = [{} for _ in range(num_layers)]
        self.layout: StepLayout | None = None

    def plan(self, layout: StepLayout) -> None:
        self.layout = layout

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        assert self.layout is not None
        outs, start = [], 0
        for qlen, ctx, pages in zip(
            self.layout.query_lens, self.layout.context_lens, self.layout.page_tables, strict=True
        ):
            seq, end = pages[0], start + qlen
            for store, new in ((self.k, k), (self.v, v)):
                old = store[layer_id].get(seq, new[:0])
                store[layer_id][seq] = torch.cat([old, new[start:end]])
            keys, values = self.k[layer_id][seq], self.v[layer_id][seq]
            assert keys.shape[0] == ctx, (keys.shape, ctx)
            groups = q.shape[1] // keys.shape[1]
            keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
            scores = torch.einsum("qhd,khd->hqk", q[start:end].double(), keys.double()) * self.scale
            qpos = torch.arange(ctx - qlen, ctx)[:, None]
            scores = scores.masked_fill(torch.arange(ctx)[None, :] > qpos, float("-inf"))
            outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), values.double()).to(q.dtype))
            start = end
        return torch.cat(outs)


def new_dense(model: Any) -> DenseAttention:
    """A fresh dense backend sized for our ``LlamaForCausalLM``."""
    return DenseAttention(model.num_layers, model.scale)


def step_logits(model: Any, attn: AttentionBackend, seqs: list[tuple[int, list[int], int]]) -> list[torch.Tensor]:
    """Run one step for ``(seq_id, new_tokens, num_cached)`` triples; logits per sequence.

    ``seq_id`` doubles as the sequence's single page id, so the dense backend
    (and a paged backend with one big page per sequence) can tell them apart.
    """
    ids = [t for _, toks, _ in seqs for t in toks]
    pos = [n + i for _, toks, n in seqs for i in range(len(toks))]
    attn.plan(
        StepLayout(
            query_lens=[len(toks) for _, toks, _ in seqs],
            context_lens=[n + len(toks) for _, toks, n in seqs],
            page_tables=[[sid] for sid, _, _ in seqs],
        )
    )
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.tensor(pos), attn)
        logits = model.compute_logits(hidden)
    return list(logits.split([len(toks) for _, toks, _ in seqs]))


def prefill_then_decode(model: Any, attn: AttentionBackend, tokens: list[int], prefix: int) -> torch.Tensor:
    """Logits (T, vocab) for ``tokens``: one prefill of ``prefix`` then one token per step."""
    rows = [step_logits(model, attn, [(0, tokens[:prefix], 0)])[0]]
    for i in range(prefix, len(tokens)):
        rows.append(step_logits(model, attn, [(0, [tokens[i]], i)])[0])
    return torch.cat(rows)


def greedy(model: Any, attn: AttentionBackend, prompt: list[int], num_tokens: int) -> list[int]:
    """Greedy continuation through ``attn``: prefill, then decode one token per step."""
    out: list[int] = []
    logits = step_logits(model, attn, [(0, prompt, 0)])[0]
    for _ in range(num_tokens):
        out.append(int(logits[-1].argmax()))
        if len(out) < num_tokens:
            logits = step_logits(model, attn, [(0, [out[-1]], len(prompt) + len(out) - 1)])[0]
    return out


def hf_logits(hf_model: PreTrainedModel, tokens: list[int]) -> torch.Tensor:
    """The oracle: HF logits (T, vocab) for one sequence."""
    with torch.inference_mode():
        return hf_model(torch.tensor([tokens])).logits[0].float()


# Router probabilities of the k-th and the next expert closer than this are a tie fp32 rounding decides: the
# expert chosen there, and every token after it, may differ between two correct implementations.
ROUTER_TIE = 1e-6


def router_near_tie(hf_model: PreTrainedModel, ids: list[int]) -> bool:
    """Whether HF's forward over ``ids`` meets a top-k routing near-tie (``ROUTER_TIE``) in any MoE layer at any
    position; False for a dense model. HF's routers take the top k of ``softmax(x @ weight.T)``."""
    gaps: list[float] = []

    def hook(module: torch.nn.Module, args: tuple[torch.Tensor, ...], _out: object) -> None:
        top_k = int(module.top_k)  # type: ignore[arg-type]
        x = args[0].reshape(-1, args[0].shape[-1])
        probs = torch.softmax(torch.nn.functional.linear(x, module.weight).float(), dim=-1)
        ranked = torch.sort(probs, dim=-1, descending=True).values
        gaps.append(float((ranked[:, top_k - 1] - ranked[:, top_k]).min()))

    routers = [m for m in hf_model.modules() if type(m).__name__.endswith("TopKRouter")]
    handles = [m.register_forward_hook(hook) for m in routers]
    try:
        with torch.inference_mode():
            hf_model(torch.tensor([ids]))
    finally:
        for h in handles:
            h.remove()
    assert len(gaps) == len(routers)
    return bool(gaps) and min(gaps) < ROUTER_TIE


def hf_greedy(hf_model: PreTrainedModel, prompt: list[int], num_tokens: int) -> list[int]:
    """HF ``generate`` greedy continuation that never stops early at EOS."""
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        # An explicit mask: otherwise generate masks prompt tokens equal to pad_token_id.
        out = hf_model.generate(  # type: ignore[operator]
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=num_tokens,
            eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
    return [int(t) for t in out[0, len(prompt) :]]


def tensor_parallel_worker(rank: int, world_size: int, model_dirs: list[str], init_file: str, out_dir: str) -> None:
    """One gloo rank: load shard ``rank`` of each model and save its logits for ``TP_PROMPT``.

    Module-level so ``torch.multiprocessing.spawn`` can import it; one spawn
    serves several models because starting processes is the slow part.
    """
    import torch.distributed as dist

    from actors.load.loader import load_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        for i, model_dir in enumerate(model_dirs):
            loaded = load_model(
                model_dir, dtype=torch.float32, device="cpu", max_model_len=64, rank=rank, world_size=world_size
            )
            # Really sharded: half the vocab rows and half the query heads on this rank.
            assert loaded.model.model.embed_tokens.weight.shape[0] == loaded.model.vocab_size // world_size
            assert loaded.model.num_heads * world_size == loaded.hf_config.num_attention_heads
            logits = step_logits(loaded.model, new_dense(loaded.model), [(0, TP_PROMPT, 0)])[0]
            torch.save(logits, f"{out_dir}/logits{i}-{rank}.pt")
    finally:
        dist.destroy_process_group()


TP_PROMPT = [1, 17, 300, 4, 4, 99, 511, 256, 3, 0]
