"""Hardware and model presets for ``flotilla plan``, kept as plain data.

Pure Python: the planner must start instantly, so nothing here imports torch,
Ray or transformers. A model is described by the handful of architecture
numbers that decide its parameter count and KV-cache size; they come from a
preset below or from a Hugging Face ``config.json``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scheduling.errors import InvalidParameterError

# Bits per element, so that int4 (half a byte) stays exact in integer arithmetic.
DTYPE_BITS: dict[str, int] = {"fp32": 32, "fp16": 16, "bf16": 16, "fp8": 8, "int8": 8, "int4": 4}
# Weight dtypes whose KV cache stays fp16 unless the user says otherwise:
# quantized weights are dequantized on the fly, activations (and so K/V) are fp16.
QUANTIZED_DTYPES = frozenset({"fp8", "int8", "int4"})


@dataclass(frozen=True)
class GpuSpec:
    """One accelerator model. ``memory_bytes`` is the nominal capacity in GB (1e9)."""

    name: str
    memory_bytes: int


@dataclass(frozen=True)
class ModelArch:
    """The architecture numbers of a Llama-family decoder (GQA attention, SwiGLU MLP, RMSNorm)."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)

    def __post_init__(self) -> None:
        for field in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                      "intermediate_size", "vocab_size"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InvalidParameterError("config", f"{field} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise InvalidParameterError(
                "config", f"num_heads ({self.num_heads}) is not a multiple of "
                f"num_kv_heads ({self.num_kv_heads})")


# Nominal (marketed) capacities. Real cards report a little more (an A100-80G
# has 80 GiB = 85.9 GB), so plans made with these are slightly conservative.
GPUS: dict[str, GpuSpec] = {g.name: g for g in (
    GpuSpec("A100-40G", 40 * 10**9),
    GpuSpec("A100-80G", 80 * 10**9),
    GpuSpec("H100", 80 * 10**9),
    GpuSpec("H200", 141 * 10**9),
    GpuSpec("L4", 24 * 10**9),
    GpuSpec("RTX-4090", 24 * 10**9),
)}

# Numbers as published in each model's config.json on the Hugging Face hub.
MODELS: dict[str, ModelArch] = {m.name: m for m in (
    ModelArch("llama-2-7b", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=32,
              head_dim=128, intermediate_size=11008, vocab_size=32000, tie_word_embeddings=False),
    ModelArch("llama-2-13b", num_layers=40, hidden_size=5120, num_heads=40, num_kv_heads=40,
              head_dim=128, intermediate_size=13824, vocab_size=32000, tie_word_embeddings=False),
    ModelArch("llama-2-70b", num_layers=80, hidden_size=8192, num_heads=64, num_kv_heads=8,
              head_dim=128, intermediate_size=28672, vocab_size=32000, tie_word_embeddings=False),
    ModelArch("llama-3-8b", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8,
              head_dim=128, intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False),
    ModelArch("llama-3-70b", num_layers=80, hidden_size=8192, num_heads=64, num_kv_heads=8,
              head_dim=128, intermediate_size=28672, vocab_size=128256, tie_word_embeddings=False),
    ModelArch("qwen2-7b", num_layers=28, hidden_size=3584, num_heads=28, num_kv_heads=4,
              head_dim=128, intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False,
              attention_bias=True),
    ModelArch("mistral-7b", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8,
              head_dim=128, intermediate_size=14336, vocab_size=32000, tie_word_embeddings=False),
)}


def _lookup(table: dict[str, Any], name: str, param: str) -> Any:
    """Case-insensitive lookup; an unknown name is an error listing the choices."""
    by_lower = {key.lower(): value for key, value in table.items()}
    found = by_lower.get(name.strip().lower())
    if found is None:
        raise InvalidParameterError(param, f"unknown {param} {name!r}; choose from {', '.join(table)}")
    return found


def get_gpu(name: str) -> GpuSpec:
    """The GPU preset called ``name`` (case-insensitive)."""
    gpu: GpuSpec = _lookup(GPUS, name, "gpu")
    return gpu


def get_model(name: str) -> ModelArch:
    """The model preset called ``name`` (case-insensitive)."""
    model: ModelArch = _lookup(MODELS, name, "preset")
    return model


def model_from_hf_config(config: dict[str, Any], name: str = "config") -> ModelArch:
    """Build a :class:`ModelArch` from a parsed Hugging Face ``config.json``.

    ``num_key_value_heads`` defaults to ``num_attention_heads`` (plain MHA),
    ``head_dim`` to ``hidden_size / num_attention_heads``, and
    ``tie_word_embeddings`` to False (the Llama, Mistral and Qwen2 default).
    Multimodal configs that nest the language model under ``text_config`` work too.
    """
    if not isinstance(config, dict):
        raise InvalidParameterError("config", "config.json must hold a JSON object")
    if "num_hidden_layers" not in config and isinstance(config.get("text_config"), dict):
        config = {**config, **config["text_config"]}
    required = ("num_hidden_layers", "hidden_size", "num_attention_heads",
                "intermediate_size", "vocab_size")
    missing = [key for key in required if config.get(key) is None]
    if missing:
        raise InvalidParameterError("config", f"{name} lacks {', '.join(missing)}")
    heads = config["num_attention_heads"]
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim")
    if head_dim is None:
        if not isinstance(heads, int) or not isinstance(hidden, int) or heads <= 0 or hidden % heads:
            raise InvalidParameterError(
                "config", f"{name} has no head_dim and hidden_size {hidden!r} is not a "
                f"multiple of num_attention_heads {heads!r}")
        head_dim = hidden // heads
    kv_heads = config.get("num_key_value_heads")
    bias = config.get("attention_bias")
    return ModelArch(
        name=name,
        num_layers=config["num_hidden_layers"],
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=heads if kv_heads is None else kv_heads,
        head_dim=head_dim,
        intermediate_size=config["intermediate_size"],
        vocab_size=config["vocab_size"],
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        # Qwen2 has q/k/v biases without saying so in its config.
        attention_bias=bool(bias) if bias is not None else config.get("model_type") == "qwen2",
    )


def read_json_file(path: str | Path, param: str) -> Any:
    """Parse a JSON file; a missing or unreadable one is an error naming ``param``."""
    p = Path(path)
    if not p.is_file():
        raise InvalidParameterError(param, f"{p} is not a file")
    try:
        return json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidParameterError(param, f"cannot read {p}: {exc}") from exc


def load_hf_config(path: str | Path) -> ModelArch:
    """Read ``path`` (a config.json, or a model folder holding one) into a :class:`ModelArch`."""
    p = Path(path)
    config = read_json_file(p / "config.json" if p.is_dir() else p, "config")
    return model_from_hf_config(config, name=str(path))
