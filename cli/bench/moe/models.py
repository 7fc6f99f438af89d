"""The two models ``flotilla bench moe`` compares: a Qwen3-MoE and a dense Qwen3 of the same active parameters.

Both share every number but the MLP: the MoE model's layers route each token
to ``top_k`` of ``experts`` gated MLPs of width ``moe_intermediate``; the dense
model's layers run one gated MLP of width ``top_k x moe_intermediate``. So a
token does the same multiply-adds in both (the MoE adds its router, ``hidden x
experts`` per layer) while the MoE model holds ``experts / top_k`` times the
MLP weights. Weights are seeded normals (std ``1/sqrt(fan_in)``, so
activations keep their scale and the router spreads tokens over the experts
as a trained, load-balanced router does); the byte-level tokenizer of the
embedded models (``actors.load.embedded``). Folders are written once under
the model cache, named by a hash of their config.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig, Qwen3Config, Qwen3MoeConfig

from actors.load.embedded import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, build_tokenizer
from actors.load.model_cache import build_once, models_dir


@dataclass(frozen=True, slots=True)
class PairShape:
    """The numbers both models share, and the MoE model's experts."""

    hidden: int = 1024
    layers: int = 8
    heads: int = 16
    kv_heads: int = 4
    head_dim: int = 64
    experts: int = 32
    top_k: int = 4
    moe_intermediate: int = 256

    @property
    def dense_intermediate(self) -> int:
        """The dense model's MLP width: what one token's ``top_k`` experts add up to."""
        return self.top_k * self.moe_intermediate


def _common(shape: PairShape) -> dict[str, object]:
    return {"vocab_size": VOCAB_SIZE, "hidden_size": shape.hidden, "num_hidden_layers": shape.layers,
            "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads, "head_dim": shape.head_dim,
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": False,
            "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID, "dtype": "float32"}


def moe_config(shape: PairShape) -> Qwen3MoeConfig:
    """Every layer sparse, top-k weights renormalised (Qwen3-MoE's ``norm_topk_prob``)."""
    return Qwen3MoeConfig.from_dict({
        **_common(shape), "num_experts": shape.experts, "num_experts_per_tok": shape.top_k,
        "moe_intermediate_size": shape.moe_intermediate, "intermediate_size": shape.dense_intermediate,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True})


def dense_config(shape: PairShape) -> Qwen3Config:
    return Qwen3Config.from_dict({**_common(shape), "intermediate_size": shape.dense_intermediate})


def _write(config: PretrainedConfig, seed: int, folder: Path) -> None:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for name, p in model.state_dict().items():  # a fixed order, so the weights are the same on every machine
        if name.endswith("norm.weight"):
            state[name] = torch.ones(p.shape)
        else:
            std = 1.0 if "embed_tokens" in name else 1.0 / p.shape[-1] ** 0.5
            state[name] = std * torch.randn(p.shape, generator=gen)
    model.load_state_dict(state, strict=True, assign=True)
    model.save_pretrained(folder, safe_serialization=True)
    build_tokenizer().save_pretrained(folder)


def ensure_model(config: PretrainedConfig, seed: int, root: Path | None = None) -> Path:
    """The folder of ``config`` with seeded weights, written on first use."""
    blob = json.dumps({"config": config.to_dict(), "seed": seed}, sort_keys=True, default=str)
    digest = hashlib.sha256(blob.encode()).hexdigest()[:12]
    return build_once(models_dir(root) / f"bench-{config.model_type}-{digest}", lambda tmp: _write(config, seed, tmp))


def shape_dict(shape: PairShape) -> dict[str, int]:
    return {**asdict(shape), "dense_intermediate": shape.dense_intermediate}
