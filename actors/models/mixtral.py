"""Mixtral: Mistral's attention with a sparse feed-forward in every layer (softmax, top-k, renormalised)."""

from __future__ import annotations

from collections.abc import Iterator

from actors.models.decoder import CausalLM, CheckpointTensor, Routed
from actors.models.decoder_args import DecoderArgs, HFConfig, common_args, config_get
from actors.models.moe import MoEArgs, SparseMoE


class MixtralForCausalLM(CausalLM):
    """Mixtral: ``block_sparse_moe`` (experts' ``w1``/``w3``/``w2`` = gate/up/down) in every layer."""

    family = "Mixtral"

    @classmethod
    def parse_args(cls, config: HFConfig) -> DecoderArgs:
        g = config_get
        moe = MoEArgs(
            num_experts=int(g(config, "num_local_experts")),
            top_k=int(g(config, "num_experts_per_tok")),
            intermediate_size=int(g(config, "intermediate_size")),
            renormalize=True,
            float32_routing_weights=True,  # HF Mixtral scales expert outputs by the float32 weights
        )
        num_layers = int(g(config, "num_hidden_layers"))
        return common_args(config, cls.family, moe=moe, moe_layers=frozenset(range(num_layers)))

    def route_checkpoint(self, hf_name: str, tensor: CheckpointTensor) -> Iterator[Routed]:
        # The MoE block answers to HF's `mlp` name in our module tree; it reads w1/w2/w3 itself.
        yield from super().route_checkpoint(hf_name, tensor)

    def _moe_target(self, name: str) -> tuple[SparseMoE, str] | None:
        # The MoE block answers to HF's `block_sparse_moe` under our `mlp` name; it reads w1/w2/w3 itself.
        return super()._moe_target(name.replace(".block_sparse_moe.", ".mlp."))
