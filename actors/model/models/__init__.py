"""Model definitions over the paged KV cache, and the architecture registry."""

from __future__ import annotations

from actors.model.models.llama import LlamaForCausalLM
from actors.model.models.registry import (
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
