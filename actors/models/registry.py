"""Which model class serves which Hugging Face architecture."""

from __future__ import annotations

from actors.models.decoder import CausalLM
from actors.models.decoder_args import HFConfig, config_get
from actors.models.gemma3 import Gemma3ForCausalLM
from actors.models.llama import LlamaForCausalLM
from actors.models.mixtral import MixtralForCausalLM
from actors.models.phi3 import Phi3ForCausalLM
from actors.models.qwen2_moe import Qwen2MoeForCausalLM
from actors.models.qwen3 import Qwen3ForCausalLM, Qwen3MoeForCausalLM
from scheduling.errors import InvalidParameterError

# HF `architectures` entry -> our implementation.
MODEL_REGISTRY: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
}

# Configs built in code may lack `architectures`; their model_type decides.
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(sorted(MODEL_REGISTRY))


class UnsupportedModelError(InvalidParameterError):
    """The model's architecture is not one flotilla implements (``param`` is ``"model"``)."""

    def __init__(self, message: str, *, param: str = "model") -> None:
        super().__init__(param, message)


def resolve_architecture(config: HFConfig) -> type[CausalLM]:
    """Return the class that implements ``config``'s architecture.

    Raises ``UnsupportedModelError`` naming the architecture and the supported ones.
    """
    names = list(config_get(config, "architectures", None) or [])
    model_type = config_get(config, "model_type", None)
    if not names and model_type in _MODEL_TYPES:
        names = [_MODEL_TYPES[model_type]]
    for name in names:
        if name in MODEL_REGISTRY:
            return MODEL_REGISTRY[name]
    found = ", ".join(names) or f"model_type {model_type!r}"
    raise UnsupportedModelError(
        f"architecture {found} is not supported; supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )
