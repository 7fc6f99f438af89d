"""The model families over the paged KV cache: one shared decoder (``decoder``), a file per family
(Llama/Mistral/Qwen2, Qwen3 and Qwen3-MoE, Qwen2-MoE, Mixtral, Gemma 3, Phi-3), the MoE layer, CPU and
quantized linears, and the architecture registry (``registry``) the loader resolves a checkpoint's config through."""

from __future__ import annotations

from actors.models.decoder import CausalLM
from actors.models.llama import LlamaForCausalLM
from actors.models.registry import (
    MODEL_REGISTRY,
    SUPPORTED_ARCHITECTURES,
    UnsupportedModelError,
    resolve_architecture,
)

__all__ = [
    "MODEL_REGISTRY",
    "SUPPORTED_ARCHITECTURES",
    "CausalLM",
    "LlamaForCausalLM",
    "UnsupportedModelError",
    "resolve_architecture",
]
