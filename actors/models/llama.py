"""The Llama family (Llama 2/3, Qwen2, Mistral) over a paged-KV attention backend.

The model runs a flattened token batch: ``input_ids`` and ``positions`` are
(T,) tensors holding every scheduled sequence's new tokens back to back, and
the attention backend (already planned for this step) knows which token
belongs to which sequence. The module tree and parameter names mirror Hugging
Face's, except that q/k/v and gate/up are fused (``qkv_proj``, ``gate_up_proj``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from actors.models.layers import (
    MergedColumnParallelLinear,
    ParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    SiluAndMul,
    VocabParallelEmbedding,
    apply_rotary,
)
from actors.models.quant_linear import Int4Codes, Int8Blocks, Int8Linear
from kvcache.attention.backend import AttentionBackend
from scheduling.errors import InvalidParameterError

HFConfig = PretrainedConfig | Mapping[str, Any]


def config_get(config: HFConfig, key: str, default: Any = None) -> Any:
    """Read ``key`` from a ``PretrainedConfig`` or its ``config.json`` dict."""
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


@dataclass(frozen=True)
class LlamaArgs:
    """The architecture numbers of one Llama-family checkpoint, normalised."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    sliding_window: int | None

    @classmethod
    def from_hf(cls, config: HFConfig) -> LlamaArgs:
        """Normalise an HF config (either transformers 4 or 5 layout of the RoPE fields)."""
        g = config_get
        hidden, heads = int(g(config, "hidden_size")), int(g(config, "num_attention_heads"))
        act = g(config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise InvalidParameterError("model", f"hidden_act {act!r} is not supported (only 'silu')")
        # transformers 5 folds rope_theta and rope_scaling into rope_parameters;
        # config.json files written by transformers 4 keep them apart.
        rope = dict(g(config, "rope_parameters", None) or g(config, "rope_scaling", None) or {})
        theta = float(rope.pop("rope_theta", None) or g(config, "rope_theta", None) or 10000.0)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if float(rope.get("partial_rotary_factor", g(config, "partial_rotary_factor", None) or 1.0)) != 1.0:
            raise InvalidParameterError("model", "partial rotary embeddings are not supported")
        arch = (g(config, "architectures", None) or [""])[0]
        is_qwen2 = arch == "Qwen2ForCausalLM" or g(config, "model_type") == "qwen2"
        # Qwen2 keeps a sliding_window number around even when it is switched off.
        window = g(config, "sliding_window", None) if g(config, "use_sliding_window", True) else None
        attention_bias = bool(g(config, "attention_bias", False))
        return cls(
            vocab_size=int(g(config, "vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(g(config, "intermediate_size")),
            num_layers=int(g(config, "num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=int(g(config, "num_key_value_heads", None) or heads),
            head_dim=int(g(config, "head_dim", None) or hidden // heads),
            rms_norm_eps=float(g(config, "rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=None if rope_type in (None, "default") else rope,
            max_position_embeddings=int(g(config, "max_position_embeddings", 2048)),
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(g(config, "mlp_bias", False)),
            tie_word_embeddings=bool(g(config, "tie_word_embeddings", False)),
            sliding_window=None if window is None else int(window),
        )


class LlamaAttention(nn.Module):
    """Self-attention: fused qkv, RoPE, backend attention over the paged KV, o_proj."""

    def __init__(self, args: LlamaArgs, layer_id: int, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.qkv_proj = QKVParallelLinear(
            args.hidden_size, args.head_dim, args.num_heads, args.num_kv_heads,
            bias=args.qkv_bias, tp_rank=tp_rank, tp_size=tp_size,
        )  # fmt: skip
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = args.head_dim
        self.o_proj = RowParallelLinear(
            args.num_heads * args.head_dim, args.hidden_size, bias=args.o_bias, tp_rank=tp_rank, tp_size=tp_size
        )

    def forward(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv = self.qkv_proj(hidden)
        # q and k heads rotate together: one RoPE pass instead of two.
        qk = apply_rotary(
            qkv[:, : q_size + kv_size].view(-1, self.num_heads + self.num_kv_heads, self.head_dim), cos, sin
        )
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, q_size + kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        out = attn.forward(self.layer_id, q, k, v)
        return self.o_proj(out.reshape(-1, q_size))


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, args: LlamaArgs, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        size = args.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            args.hidden_size, [size, size], bias=args.mlp_bias, tp_rank=tp_rank, tp_size=tp_size
        )
        self.act = SiluAndMul()
        self.down_proj = RowParallelLinear(size, args.hidden_size, bias=args.mlp_bias, tp_rank=tp_rank, tp_size=tp_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block; residual adds happen in the model dtype, as in HF."""

    def __init__(self, args: LlamaArgs, layer_id: int, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = LlamaAttention(args, layer_id, tp_rank, tp_size)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = LlamaMLP(args, tp_rank, tp_size)

    def forward(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, attn)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm (HF's ``model.`` prefix)."""

    def __init__(self, args: LlamaArgs, max_positions: int, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(args.vocab_size, args.hidden_size, tp_rank=tp_rank, tp_size=tp_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(args, i, tp_rank, tp_size) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        # One table for all layers; cos/sin are gathered once per step.
        self.rotary_emb = RotaryEmbedding(args.head_dim, max_positions, args.rope_theta, args.rope_scaling)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend, num_layers: int | None = None
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb.cos_sin(positions, hidden.dtype)
        layers = self.layers if num_layers is None else self.layers[:num_layers]
        for layer in layers:
            hidden = layer(hidden, cos, sin, attn)
        return self.norm(hidden)


# HF checkpoint name fragment -> (our fused module fragment, shard id).
FUSED_CHECKPOINT_NAMES: dict[str, tuple[str, str | int]] = {
    ".q_proj.": (".qkv_proj.", "q"),
    ".k_proj.": (".qkv_proj.", "k"),
    ".v_proj.": (".qkv_proj.", "v"),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


class LlamaForCausalLM(nn.Module):
    """Llama / Qwen2 / Mistral causal LM on the paged KV cache.

    Geometry for building the KV pool and the attention backend (per rank):
    ``num_layers``, ``num_heads``, ``num_kv_heads``, ``head_dim``, ``scale``.

    Args:
        config: the HF config (``PretrainedConfig`` or the ``config.json`` dict).
        max_model_len: longest sequence served; sizes the RoPE table and is
            checked against a sliding window, which flotilla does not implement.
        tp_rank, tp_size: tensor-parallel rank and world size.
    """

    def __init__(
        self, config: HFConfig, *, max_model_len: int | None = None, tp_rank: int = 0, tp_size: int = 1
    ) -> None:
        super().__init__()
        args = LlamaArgs.from_hf(config)
        max_len = max_model_len or args.max_position_embeddings
        if args.sliding_window is not None and max_len > args.sliding_window:
            raise InvalidParameterError(
                "max_model_len",
                f"the model uses sliding-window attention over {args.sliding_window} tokens, which is "
                f"not supported; max_model_len ({max_len}) must be at most {args.sliding_window}",
            )
        self.args, self.tp_rank, self.tp_size = args, tp_rank, tp_size
        self.model = LlamaModel(args, max_len, tp_rank, tp_size)
        self.lm_head = ParallelLMHead(args.vocab_size, args.hidden_size, tp_rank=tp_rank, tp_size=tp_size)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.num_layers = args.num_layers
        # Same arithmetic as QKVParallelLinear (which validated it): a replicated KV head is one per rank.
        self.num_heads = args.num_heads // tp_size
        self.num_kv_heads = max(1, args.num_kv_heads // tp_size)
        self.head_dim = args.head_dim
        self.scale = args.head_dim**-0.5
        self.vocab_size = args.vocab_size

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend, num_layers: int | None = None
    ) -> torch.Tensor:
        """Hidden states (T, hidden) after the final norm; ``attn.plan`` was called for this step.

        ``num_layers`` runs only the first that many decoder layers (then the
        final norm): the self-draft of speculative decoding.
        """
        return self.model(input_ids, positions, attn, num_layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits (N, vocab) for the rows of ``hidden`` that will be sampled."""
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | Int4Codes | Int8Blocks]]) -> set[str]:
        """Copy HF-named full tensors into this rank's shards; return our loaded names.

        A linear weight may come as ``Int4Codes`` (read quantized from the file):
        the layer then packs it and keeps no float weight; the embedding or
        head as ``Int8Blocks``, kept as they are. Raises ``ValueError``
        for a name the model has no place for, and for parameters the
        checkpoint never provided.
        """
        params = dict(self.named_parameters())
        loaded: set[tuple[str, str | int | None]] = set()
        for hf_name, tensor in weights:
            if "rotary_emb.inv_freq" in hf_name:
                continue  # old checkpoints saved this buffer; we compute it.
            if hf_name.startswith("lm_head.") and self.args.tie_word_embeddings:
                continue  # the head is the embedding
            name, shard_id = hf_name, None
            for hf_part, (ours, sid) in FUSED_CHECKPOINT_NAMES.items():
                if hf_part in hf_name:
                    name, shard_id = hf_name.replace(hf_part, ours), sid
                    break
            if name not in params:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no place in {type(self).__name__}")
            module_name, _, param_name = name.rpartition(".")
            module = self.get_submodule(module_name)
            loader = getattr(module, "load_weight", None)
            if loader is not None:
                loader(param_name, tensor, shard_id)
            else:
                assert isinstance(tensor, torch.Tensor), f"{hf_name} cannot load quantized"
                params[name].data.copy_(tensor)
            loaded.add((name, shard_id))
        # A fused parameter is complete only once every one of its parts arrived.
        expected = {(n, s) for n in params for s in _shards_of(self.get_submodule(n.rpartition(".")[0]))}
        missing = sorted(f"{n}" if s is None else f"{n}[{s}]" for n, s in expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:4]}")
        return {n for n, _ in loaded}

    def quantize_weights(self, method: str, group_size: int | None) -> None:
        """Quantize every linear layer still holding a float weight, and the LM head to int8.

        ``method`` is ``int8`` (per output channel) or ``int4`` (groups of
        ``group_size``). The head is int8 per vocab row with either method (int4
        is the linears'), unless it was loaded as int8 blocks (``Int8Blocks``:
        GGUF Q8_0), which it keeps; a tied embedding reads the same int8 rows.
        Each float weight is freed once replaced.
        """
        for module in self.modules():
            if isinstance(module, ParallelLinear):
                module.quantize(method, group_size)
        tied = self.args.tie_word_embeddings
        loaded = self.model.embed_tokens.quant if tied else self.lm_head.quant
        head = loaded if loaded is not None else Int8Linear.from_float(self.lm_head.weight.data)
        if self.lm_head.quant is None:
            self.lm_head.set_quant(head)
        if tied and self.model.embed_tokens.quant is None:
            self.model.embed_tokens.set_quant(head)

    def weight_bytes(self) -> int:
        """Bytes of every parameter and quantized buffer (not the RoPE tables), each counted once."""
        seen: set[int] = set()
        total = 0
        tensors: list[torch.Tensor] = [p for _, p in self.named_parameters()]
        tensors += [b for name, b in self.named_buffers() if not name.startswith("model.rotary_emb.")]
        for t in tensors:
            if t.data_ptr() not in seen and t.numel():
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total


def _shards_of(module: nn.Module) -> tuple[str | int | None, ...]:
    return module.shard_ids if isinstance(module, ParallelLinear) else (None,)
