"""Qwen3 and Qwen3-MoE: the Llama decoder with RMS-normed q/k heads; the MoE variant routes each token to top-k experts."""

from __future__ import annotations

from actors.models.decoder import CausalLM
from actors.models.decoder_args import DecoderArgs, HFConfig, common_args, config_get
from actors.models.moe import MoEArgs


def moe_layer_ids(config: HFConfig, num_layers: int) -> frozenset[int]:
    """Layers with a sparse feed-forward, by the Qwen MoE rule: every ``decoder_sparse_step``-th, minus ``mlp_only_layers``."""
    step = int(config_get(config, "decoder_sparse_step", 1) or 1)
    dense = set(config_get(config, "mlp_only_layers", None) or [])
    if int(config_get(config, "num_experts", 0) or 0) <= 0:
        return frozenset()
    return frozenset(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)


def qwen_moe_args(config: HFConfig, *, shared: bool) -> MoEArgs:
    """The routed experts of a Qwen2-/Qwen3-MoE config (softmax over all experts, top-k, optional renormalisation)."""
    g = config_get
    return MoEArgs(
        num_experts=int(g(config, "num_experts")),
        top_k=int(g(config, "num_experts_per_tok")),
        intermediate_size=int(g(config, "moe_intermediate_size")),
        renormalize=bool(g(config, "norm_topk_prob", False)),
        shared_intermediate_size=int(g(config, "shared_expert_intermediate_size")) if shared else None,
    )


class Qwen3ForCausalLM(CausalLM):
    """Qwen3 (dense): q/k RMS norms per head before RoPE; biases on all four projections when ``attention_bias``."""

    family = "Qwen3"

    @classmethod
    def parse_args(cls, config: HFConfig) -> DecoderArgs:
        return common_args(config, cls.family, qk_norm=True)


class Qwen3MoeForCausalLM(CausalLM):
    """Qwen3-MoE: Qwen3's attention; sparse layers route each token to ``num_experts_per_tok`` of ``num_experts``."""

    family = "Qwen3-MoE"

    @classmethod
    def parse_args(cls, config: HFConfig) -> DecoderArgs:
        num_layers = int(config_get(config, "num_hidden_layers"))
        return common_args(
            config, cls.family, qk_norm=True, moe=qwen_moe_args(config, shared=False),
            moe_layers=moe_layer_ids(config, num_layers),
        )  # fmt: skip
