"""The model families: their layers over the paged KV cache, CPU and quantized linears, and the architecture registry (``registry``) the loader resolves a checkpoint's config through."""

from __future__ import annotations

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
    "LlamaForCausalLM",
    "UnsupportedModelError",
    "resolve_architecture",
]
