"""Phi-3: the Llama decoder whose checkpoint stores q/k/v and gate/up already fused; a sliding window on every layer."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from actors.models.decoder import CausalLM, CheckpointTensor, Routed
from actors.models.decoder_args import DecoderArgs, HFConfig, common_args


class Phi3ForCausalLM(CausalLM):
    """Phi-3 (mini/medium, short-context RoPE). ``longrope`` (the 128k variants) and partial rotary are refused by name."""

    family = "Phi-3"

    @classmethod
    def parse_args(cls, config: HFConfig) -> DecoderArgs:
        return common_args(config, cls.family)

    def route_checkpoint(self, hf_name: str, tensor: CheckpointTensor) -> Iterator[Routed]:
        """Split the fused ``qkv_proj`` (q, k, v rows) and ``gate_up_proj`` (gate, up rows) into the parts our layers shard."""
        if ".qkv_proj." not in hf_name and ".gate_up_proj." not in hf_name:
            yield from super().route_checkpoint(hf_name, tensor)
            return
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{hf_name}: quantized fused Phi-3 weights are not supported")
        a = self.args
        if ".qkv_proj." in hf_name:
            sizes = [a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.num_kv_heads * a.head_dim]
            for part, qkv_id in zip(tensor.split(sizes), ("q", "k", "v"), strict=True):
                yield hf_name, qkv_id, part
        else:
            for part, mlp_id in zip(tensor.chunk(2), (0, 1), strict=True):
                yield hf_name, mlp_id, part
