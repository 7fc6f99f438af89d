"""Qwen2-MoE (Qwen1.5-MoE): Qwen2's attention (q/k/v biases) with routed experts plus a sigmoid-gated shared expert."""

from __future__ import annotations

from actors.models.decoder import CausalLM
from actors.models.decoder_args import DecoderArgs, HFConfig, common_args, config_get
from actors.models.qwen3 import moe_layer_ids, qwen_moe_args


class Qwen2MoeForCausalLM(CausalLM):
    """Qwen2-MoE: every token also runs the shared expert, weighted by ``sigmoid(shared_expert_gate(x))``."""

    family = "Qwen2-MoE"

    @classmethod
    def parse_args(cls, config: HFConfig) -> DecoderArgs:
        num_layers = int(config_get(config, "num_hidden_layers"))
        return common_args(
            config, cls.family, qkv_bias=bool(config_get(config, "qkv_bias", True)), o_bias=False,
            moe=qwen_moe_args(config, shared=True), moe_layers=moe_layer_ids(config, num_layers),
        )  # fmt: skip
