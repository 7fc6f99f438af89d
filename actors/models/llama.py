"""The Llama family (Llama 2/3, Qwen2, Mistral): the plain pre-norm SwiGLU decoder of ``decoder``."""

from __future__ import annotations

from actors.models.decoder import CausalLM
from actors.models.decoder_args import DecoderArgs, HFConfig, common_args, config_get


def llama_args(config: HFConfig) -> DecoderArgs:
    """Normalise a Llama, Mistral or Qwen2 config (either transformers 4 or 5 layout of the RoPE fields)."""
    arch = (config_get(config, "architectures", None) or [""])[0]
    is_qwen2 = arch == "Qwen2ForCausalLM" or config_get(config, "model_type") == "qwen2"
    attention_bias = bool(config_get(config, "attention_bias", False))
    # Qwen2 always has q/k/v biases and never an o_proj bias.
    return common_args(
        config, "Llama", qkv_bias=is_qwen2 or attention_bias, o_bias=attention_bias and not is_qwen2
    )


class LlamaForCausalLM(CausalLM):
    """Llama / Qwen2 / Mistral causal LM on the paged KV cache (sliding windows per layer where the config has them)."""

    family = "Llama"

    @classmethod
    def parse_args(cls, config: HFConfig) -> DecoderArgs:
        return llama_args(config)
