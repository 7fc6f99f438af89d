"""The decoder-only transformer every model family is built from, over a paged-KV attention backend.

A family (``llama.py``, ``qwen3.py``, ``gemma3.py``, ``phi3.py``,
``mixtral.py``, ``qwen2_moe.py``) turns its Hugging Face config into one
``DecoderArgs`` (refusing by name what it does not implement) and, where its
checkpoint names differ, maps them; everything else is shared here: the
attention block (fused qkv, optional per-head q/k norm, RoPE per layer kind,
a per-layer sliding window the backend applies), the feed-forward (SwiGLU or
GeGLU, or a ``SparseMoE``), pre-norm or sandwich-norm residual blocks, the
checkpoint loader and the quantization hooks.

The model runs a flattened token batch: ``input_ids`` and ``positions`` are
(T,) tensors holding every scheduled sequence's new tokens back to back, and
the attention backend (already planned for this step) knows which token
belongs to which sequence. Module and parameter names mirror Hugging Face's,
except that q/k/v and gate/up are fused (``qkv_proj``, ``gate_up_proj``).
"""

from __future__ import annotations

from abc import ABCMeta, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from actors.models.decoder_args import DecoderArgs, HFConfig
from actors.models.layers import (
    MergedColumnParallelLinear,
    ParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    apply_rotary,
)
from actors.models.moe import SparseMoE
from actors.models.quant_linear import Int4Codes, Int8Blocks, Int8Linear
from kvcache.attention.backend import AttentionBackend
from scheduling.errors import InvalidParameterError

CheckpointTensor = torch.Tensor | Int4Codes | Int8Blocks

def _norm(args: DecoderArgs, size: int) -> nn.Module:
    return GemmaRMSNorm(size, args.rms_norm_eps) if args.norm == "gemma" else RMSNorm(size, args.rms_norm_eps)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMS norm: float32 ``x * rsqrt(mean(x^2) + eps) * (1 + w)``, cast back after the product."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class Attention(nn.Module):
    """Self-attention: fused qkv, optional per-head q/k norm, RoPE, backend attention, o_proj.

    The layer's sliding window is the backend's to apply (``sliding_windows``
    given at its construction, from ``CausalLM.sliding_windows``).
    """

    def __init__(self, args: DecoderArgs, layer_id: int, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.qkv_proj = QKVParallelLinear(
            args.hidden_size, args.head_dim, args.num_heads, args.num_kv_heads,
            bias=args.qkv_bias, tp_rank=tp_rank, tp_size=tp_size,
        )  # fmt: skip
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = args.head_dim
        self.q_norm = _norm(args, args.head_dim) if args.qk_norm else None
        self.k_norm = _norm(args, args.head_dim) if args.qk_norm else None
        self.o_proj = RowParallelLinear(
            args.num_heads * args.head_dim, args.hidden_size, bias=args.o_bias, tp_rank=tp_rank, tp_size=tp_size
        )

    def forward(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv = self.qkv_proj(hidden)
        qk = qkv[:, : q_size + kv_size].view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        # q and k heads rotate together: one RoPE pass instead of two.
        q, k = apply_rotary(qk, cos, sin).split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, q_size + kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        out = attn.forward(self.layer_id, q, k, v)
        return self.o_proj(out.reshape(-1, q_size))


class GatedMLP(nn.Module):
    """Gated feed-forward: ``down(act(gate(x)) * up(x))`` with SiLU (SwiGLU) or tanh-GELU (GeGLU)."""

    def __init__(self, args: DecoderArgs, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        size = args.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            args.hidden_size, [size, size], bias=args.mlp_bias, tp_rank=tp_rank, tp_size=tp_size
        )
        self.act = args.act
        self.down_proj = RowParallelLinear(size, args.hidden_size, bias=args.mlp_bias, tp_rank=tp_rank, tp_size=tp_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        act = F.silu(gate) if self.act == "silu" else F.gelu(gate, approximate="tanh")
        return self.down_proj(act * up)


class DecoderLayer(nn.Module):
    """Pre-norm block (Gemma: also a norm on each branch's output); residual adds in the model dtype, as in HF."""

    def __init__(self, args: DecoderArgs, layer_id: int, tp_rank: int, tp_size: int, expert_parallel: bool) -> None:
        super().__init__()
        self.input_layernorm = _norm(args, args.hidden_size)
        self.self_attn = Attention(args, layer_id, tp_rank, tp_size)
        self.post_attention_layernorm = _norm(args, args.hidden_size)
        # Gemma's sandwich: post_attention_layernorm closes the attention branch
        # and the MLP branch gets a norm of its own on each side.
        self.pre_feedforward_layernorm = _norm(args, args.hidden_size) if args.sandwich_norms else None
        self.post_feedforward_layernorm = _norm(args, args.hidden_size) if args.sandwich_norms else None
        self.mlp: nn.Module
        if layer_id in args.moe_layers:
            assert args.moe is not None
            moe = replace(args.moe, expert_parallel=expert_parallel)
            self.mlp = SparseMoE(args.hidden_size, moe, tp_rank=tp_rank, tp_size=tp_size)
        else:
            self.mlp = GatedMLP(args, tp_rank, tp_size)
        self.rope_index = 1 if args.local_rope is not None and args.layer_windows[layer_id] is not None else 0

    def forward(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        if self.pre_feedforward_layernorm is None or self.post_feedforward_layernorm is None:
            hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, attn)
            return hidden + self.mlp(self.post_attention_layernorm(hidden))
        hidden = hidden + self.post_attention_layernorm(self.self_attn(self.input_layernorm(hidden), cos, sin, attn))
        return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))


class DecoderModel(nn.Module):
    """Embedding, decoder layers and final norm (HF's ``model.`` prefix)."""

    def __init__(
        self, args: DecoderArgs, max_positions: int, tp_rank: int, tp_size: int, expert_parallel: bool
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(args.vocab_size, args.hidden_size, tp_rank=tp_rank, tp_size=tp_size)
        self.layers = nn.ModuleList(
            DecoderLayer(args, i, tp_rank, tp_size, expert_parallel) for i in range(args.num_layers)
        )
        self.norm = _norm(args, args.hidden_size)
        self.embed_scale = args.embed_scale
        # One table per RoPE kind (global, and Gemma's local); cos/sin are gathered once per step.
        ropes = [args.rope] if args.local_rope is None else [args.rope, args.local_rope]
        self.rotary = nn.ModuleList(RotaryEmbedding(args.head_dim, max_positions, r.theta, r.scaling) for r in ropes)

    @property
    def rotary_emb(self) -> RotaryEmbedding:
        """The global layers' RoPE table."""
        table = self.rotary[0]
        assert isinstance(table, RotaryEmbedding)
        return table

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend, num_layers: int | None = None
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            # HF multiplies by the scale rounded to the model dtype.
            hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)
        tables = [table.cos_sin(positions, hidden.dtype) for table in self.rotary]  # type: ignore[operator]
        layers = self.layers if num_layers is None else self.layers[:num_layers]
        for layer in layers:
            assert isinstance(layer, DecoderLayer)
            cos, sin = tables[layer.rope_index]
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

# A tensor routed to a parameter: (our parameter name, shard id of a fused weight, the tensor).
Routed = tuple[str, str | int | None, CheckpointTensor]


class CausalLM(nn.Module, metaclass=ABCMeta):
    """A decoder-only causal LM on the paged KV cache; each family subclasses it with its config parser.

    Geometry for building the KV pool and the attention backend (per rank):
    ``num_layers``, ``num_heads``, ``num_kv_heads``, ``head_dim``, ``scale``
    (softmax scale) and ``sliding_windows`` (one entry per layer).

    Args:
        config: the HF config (``PretrainedConfig`` or the ``config.json`` dict).
        max_model_len: longest sequence served; sizes the RoPE tables.
        tp_rank, tp_size: tensor-parallel rank and world size.
        expert_parallel: MoE experts spread whole over the ranks instead of
            each expert split over all of them; refused for a dense model.
    """

    family = "decoder"

    @classmethod
    @abstractmethod
    def parse_args(cls, config: HFConfig) -> DecoderArgs:
        """This family's ``DecoderArgs`` for ``config``; raises ``InvalidParameterError`` for what it lacks."""

    def __init__(
        self,
        config: HFConfig,
        *,
        max_model_len: int | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        expert_parallel: bool = False,
    ) -> None:
        super().__init__()
        args = self.parse_args(config)
        if expert_parallel and args.moe is None:
            raise InvalidParameterError(
                "expert_parallel", f"{type(self).__name__} has no experts to spread; expert_parallel needs an MoE model"
            )
        max_len = max_model_len or args.max_position_embeddings
        self.args, self.tp_rank, self.tp_size = args, tp_rank, tp_size
        self.model = DecoderModel(args, max_len, tp_rank, tp_size, expert_parallel)
        self.lm_head = ParallelLMHead(args.vocab_size, args.hidden_size, tp_rank=tp_rank, tp_size=tp_size)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.num_layers = args.num_layers
        # Same arithmetic as QKVParallelLinear (which validated it): a replicated KV head is one per rank.
        self.num_heads = args.num_heads // tp_size
        self.num_kv_heads = max(1, args.num_kv_heads // tp_size)
        self.head_dim = args.head_dim
        self.scale = args.attn_scale if args.attn_scale is not None else args.head_dim**-0.5
        self.sliding_windows = args.layer_windows
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
        logits = self.lm_head(hidden)
        cap = self.args.final_logit_softcap
        if cap is not None:  # Gemma: cap / tanh / scale back, in the model dtype as HF does
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def moe_blocks(self) -> list[SparseMoE]:
        """The mixture-of-experts feed-forwards, in layer order (empty for a dense model)."""
        return [m for m in self.modules() if isinstance(m, SparseMoE)]

    def expert_tokens(self) -> torch.Tensor | None:
        """Routing choices per MoE layer (in layer order) per expert since load: int64 (layers, experts), on the
        device; None if dense. Per layer, not summed: each layer's experts are its own, so a hot expert shows
        only against its layer's others (``ReadExpertTokens`` reads it for the metrics)."""
        blocks = self.moe_blocks()
        if not blocks:
            return None
        return torch.stack([b.expert_tokens for b in blocks])

    def route_checkpoint(self, hf_name: str, tensor: CheckpointTensor) -> Iterator[Routed]:
        """Our (parameter, shard id, tensor) triples for one checkpoint tensor; families override to split or rename."""
        for hf_part, (ours, sid) in FUSED_CHECKPOINT_NAMES.items():
            if hf_part in hf_name:
                yield hf_name.replace(hf_part, ours), sid, tensor
                return
        yield hf_name, None, tensor

    def _moe_target(self, name: str) -> tuple[SparseMoE, str] | None:
        """(block, name inside it) when ``name`` is under a MoE layer's feed-forward."""
        parts = name.split(".")
        if len(parts) > 4 and parts[:2] == ["model", "layers"] and parts[3] == "mlp":
            mlp = self.model.layers[int(parts[2])].mlp
            if isinstance(mlp, SparseMoE):
                return mlp, ".".join(parts[4:])
        return None

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> set[str]:
        """Copy HF-named full tensors into this rank's shards; return our loaded names.

        A linear weight may come as ``Int4Codes`` (read quantized from the file):
        the layer then packs it and keeps no float weight; the embedding or
        head as ``Int8Blocks``, kept as they are. Raises ``ValueError``
        for a name the model has no place for, and for parameters the
        checkpoint never provided.
        """
        params = dict(self.named_parameters())
        loaded: set[tuple[str, str | int | None]] = set()
        moe_loaded: set[tuple[int, str]] = set()
        for hf_name, full in weights:
            if "rotary_emb.inv_freq" in hf_name:
                continue  # old checkpoints saved this buffer; we compute it.
            if hf_name.startswith("lm_head.") and self.args.tie_word_embeddings:
                continue  # the head is the embedding
            # Expert names go to their block as they are (its own gate/up parts), before any fusing rename.
            routed = self.route_checkpoint(hf_name, full) if self._moe_target(hf_name) is None else [(hf_name, None, full)]
            for name, shard_id, tensor in routed:
                target = self._moe_target(name)
                if target is not None:
                    block, inner = target
                    if not isinstance(tensor, torch.Tensor):
                        raise ValueError(f"{hf_name}: quantized expert weights are not supported")
                    block.load_checkpoint(inner, tensor)
                    moe_loaded.add((id(block), inner))
                    continue
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
        moe_prefixes = tuple(f"{n}." for n, m in self.named_modules() if isinstance(m, SparseMoE))
        expected = {
            (n, s)
            for n in params
            if not n.startswith(moe_prefixes)
            for s in _shards_of(self.get_submodule(n.rpartition(".")[0]))
        }
        missing = sorted(f"{n}" if s is None else f"{n}[{s}]" for n, s in expected - loaded)
        for block_name, block in self.named_modules():
            if isinstance(block, SparseMoE):
                missing += sorted(f"{block_name}.{n}" for n in block.checkpoint_names() if (id(block), n) not in moe_loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:4]}")
        return {n for n, _ in loaded}

    def quantize_weights(self, method: str, group_size: int | None) -> None:
        """Quantize every linear layer still holding a float weight, and the LM head to int8.

        ``method`` is ``int8`` (per output channel) or ``int4`` (groups of
        ``group_size``). The head is int8 per vocab row with either method (int4
        is the linears'), unless it was loaded as int8 blocks (``Int8Blocks``:
        GGUF Q8_0), which it keeps; a tied embedding reads the same int8 rows.
        Each float weight is freed once replaced. Experts have no quantized
        path: an MoE model is refused by name.
        """
        if self.args.moe is not None:
            raise InvalidParameterError(
                "quantization", f"{type(self).__name__}: weight quantization of mixture-of-experts models is not supported"
            )
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
        """Bytes of every parameter and quantized buffer (not the RoPE tables or counters), each counted once."""
        seen: set[int] = set()
        total = 0
        tensors: list[torch.Tensor] = [p for _, p in self.named_parameters()]
        tensors += [
            b for name, b in self.named_buffers() if not name.startswith("model.rotary.") and "expert_tokens" not in name
        ]
        for t in tensors:
            if t.data_ptr() not in seen and t.numel():
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total


def _shards_of(module: nn.Module) -> tuple[str | int | None, ...]:
    return module.shard_ids if isinstance(module, ParallelLinear) else (None,)
