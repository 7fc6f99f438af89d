"""Hardware and model presets for ``flotilla plan``, kept as plain data.

Pure Python: the planner must start instantly, so nothing here imports torch,
Ray or transformers. A model is described by the handful of architecture
numbers that decide its parameter count, KV-cache size and decode traffic:
Llama-family decoders (Llama, Mistral, Qwen2), Qwen3 (per-head q/k norms),
Gemma 2/3 (sandwich norms, sliding-window layers), Phi-3, and mixtures of
experts (Mixtral, Qwen3-MoE, Qwen2-MoE with its shared expert). They come from
a preset below or from a Hugging Face ``config.json``.
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
    """One accelerator model. ``memory_bytes`` is the nominal capacity in GB (1e9);
    ``bandwidth_bytes_per_s`` its memory bandwidth and ``bf16_flops`` its dense bf16
    matrix rate, from the datasheets unless a comment says measured (the roofline
    profiles of ``cli.simulate.profile``)."""

    name: str
    memory_bytes: int
    bandwidth_bytes_per_s: float
    bf16_flops: float


@dataclass(frozen=True)
class ModelArch:
    """The architecture numbers of a decoder: GQA attention, gated MLP (SwiGLU / GeGLU: 3 matrices), RMSNorms.

    Mixture of experts: a layer ``i`` is a MoE layer when ``num_experts > 0``,
    ``i`` is not in ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``
    (the Qwen2-MoE / Qwen3-MoE rule; Mixtral: every layer). A MoE layer holds a
    router (``hidden x num_experts``), ``num_experts`` gated MLPs of width
    ``moe_intermediate_size`` of which each token runs ``num_experts_per_tok``,
    and, when ``shared_expert_intermediate_size`` > 0, a shared expert every
    token runs plus its one-output sigmoid gate (Qwen2-MoE). The other layers
    have a dense MLP of width ``intermediate_size``.

    Sliding windows: the layers in ``sliding_layers`` attend to the last
    ``sliding_window`` tokens (the query itself included); the others to the
    whole sequence.
    """

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2, Qwen2-MoE)
    qk_norm: bool = False  # per-head RMSNorm of q and k: 2 x head_dim weights per layer (Qwen3, Gemma 3)
    norms_per_layer: int = 2  # hidden-size norms per layer: 2 pre-norms; 4 with Gemma's post-norms
    num_experts: int = 0  # routed experts per MoE layer; 0: dense
    num_experts_per_tok: int = 0  # top-k: routed experts each token runs
    moe_intermediate_size: int = 0  # width of one routed expert's gated MLP
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE shared expert's width; 0: none
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()  # dense layers of a MoE model
    sliding_window: int | None = None  # tokens a windowed layer attends to
    sliding_layers: tuple[int, ...] = ()  # the layers that attend within sliding_window

    def __post_init__(self) -> None:
        for field in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                      "intermediate_size", "vocab_size", "norms_per_layer", "decoder_sparse_step"):
            _check_int(field, getattr(self, field), minimum=1)
        for field in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                      "shared_expert_intermediate_size"):
            _check_int(field, getattr(self, field), minimum=0)
        if self.num_heads % self.num_kv_heads:
            raise InvalidParameterError(
                "config", f"num_heads ({self.num_heads}) is not a multiple of "
                f"num_kv_heads ({self.num_kv_heads})")
        if self.num_experts:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise InvalidParameterError(
                    "config", f"num_experts_per_tok must be in 1..{self.num_experts} (num_experts), "
                    f"got {self.num_experts_per_tok!r}")
            if not self.moe_intermediate_size:
                raise InvalidParameterError("config", "a MoE model needs a positive moe_intermediate_size")
        elif self.num_experts_per_tok or self.shared_expert_intermediate_size:
            raise InvalidParameterError(
                "config", "num_experts_per_tok and shared_expert_intermediate_size need num_experts > 0")
        for field in ("mlp_only_layers", "sliding_layers"):
            layers = getattr(self, field)
            if not isinstance(layers, tuple) or any(
                    not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < self.num_layers
                    for i in layers):
                raise InvalidParameterError(
                    "config", f"{field} must list layer indices in 0..{self.num_layers - 1}, got {layers!r}")
        if self.sliding_window is not None:
            _check_int("sliding_window", self.sliding_window, minimum=1)
        elif self.sliding_layers:
            raise InvalidParameterError("config", "sliding_layers are given but no sliding_window")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Indices of the layers whose MLP is a mixture of experts."""
        if not self.is_moe:
            return ()
        dense = set(self.mlp_only_layers)
        return tuple(i for i in range(self.num_layers)
                     if i not in dense and (i + 1) % self.decoder_sparse_step == 0)

    @property
    def num_sliding_layers(self) -> int:
        return len(set(self.sliding_layers))


def _check_int(field: str, value: object, *, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        kind = "positive" if minimum > 0 else "non-negative"
        raise InvalidParameterError("config", f"{field} must be a {kind} integer, got {value!r}")


def windowed_layers(num_layers: int, pattern: int) -> tuple[int, ...]:
    """The sliding-window layers of a ``sliding_window_pattern``: every ``pattern``-th layer
    (1-based) is global, the others windowed, as transformers expands Gemma 2/3 configs."""
    return tuple(i for i in range(num_layers) if (i + 1) % pattern)


# Nominal (marketed) capacities. Real cards report a little more (an A100-80G
# has 80 GiB = 85.9 GB), so plans made with these are slightly conservative.
GPUS: dict[str, GpuSpec] = {g.name: g for g in (
    GpuSpec("A100-40G", 40 * 10**9, 1.555e12, 312e12),
    GpuSpec("A100-80G", 80 * 10**9, 2.039e12, 312e12),
    GpuSpec("H100", 80 * 10**9, 3.35e12, 989e12),
    # bf16 rate as measured on this workplace's H200s (KINDS.md), not the datasheet's 989e12.
    GpuSpec("H200", 141 * 10**9, 4.8e12, 790e12),
    GpuSpec("L4", 24 * 10**9, 0.3e12, 121e12),
    GpuSpec("RTX-4090", 24 * 10**9, 1.008e12, 165e12),
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
    ModelArch("qwen3-8b", num_layers=36, hidden_size=4096, num_heads=32, num_kv_heads=8,
              head_dim=128, intermediate_size=12288, vocab_size=151936, tie_word_embeddings=False,
              qk_norm=True),
    # The text model of Gemma 3 27B (its config.json's text_config; the vision tower is not counted).
    ModelArch("gemma-3-27b", num_layers=62, hidden_size=5376, num_heads=32, num_kv_heads=16,
              head_dim=128, intermediate_size=21504, vocab_size=262208, tie_word_embeddings=True,
              qk_norm=True, norms_per_layer=4, sliding_window=1024,
              sliding_layers=windowed_layers(62, 6)),
    ModelArch("phi-3-mini", num_layers=32, hidden_size=3072, num_heads=32, num_kv_heads=32,
              head_dim=96, intermediate_size=8192, vocab_size=32064, tie_word_embeddings=False,
              sliding_window=2047, sliding_layers=tuple(range(32))),
    ModelArch("qwen3-30b-a3b", num_layers=48, hidden_size=2048, num_heads=32, num_kv_heads=4,
              head_dim=128, intermediate_size=6144, vocab_size=151936, tie_word_embeddings=False,
              qk_norm=True, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768),
    ModelArch("mixtral-8x7b", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8,
              head_dim=128, intermediate_size=14336, vocab_size=32000, tie_word_embeddings=False,
              num_experts=8, num_experts_per_tok=2, moe_intermediate_size=14336),
    ModelArch("qwen1.5-moe-a2.7b", num_layers=24, hidden_size=2048, num_heads=16, num_kv_heads=16,
              head_dim=128, intermediate_size=5632, vocab_size=151936, tie_word_embeddings=False,
              attention_bias=True, num_experts=60, num_experts_per_tok=4, moe_intermediate_size=1408,
              shared_expert_intermediate_size=5632),
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


# Facts config.json files leave to the model type (transformers' config classes supply them).
_QK_NORM_TYPES = frozenset({"qwen3", "qwen3_moe", "gemma3", "gemma3_text"})
_SANDWICH_NORM_TYPES = frozenset({"gemma2", "gemma3", "gemma3_text"})  # 4 norms per layer
_QKV_BIAS_TYPES = frozenset({"qwen2", "qwen2_moe"})  # q/k/v biases without attention_bias in the config
_NO_WINDOW_BY_DEFAULT: dict[str, object] = {"use_sliding_window": False}
_GEMMA3_DEFAULTS: dict[str, object] = {"tie_word_embeddings": True, "vocab_size": 262208,
                                       "sliding_window_pattern": 6}
_MODEL_TYPE_DEFAULTS: dict[str, dict[str, object]] = {
    "gemma": {"tie_word_embeddings": True},
    "gemma2": {"tie_word_embeddings": True, "sliding_window_pattern": 2},
    "gemma3": _GEMMA3_DEFAULTS,
    "gemma3_text": _GEMMA3_DEFAULTS,
    "qwen2": _NO_WINDOW_BY_DEFAULT,
    "qwen2_moe": _NO_WINDOW_BY_DEFAULT,
    "qwen3": _NO_WINDOW_BY_DEFAULT,
    "qwen3_moe": _NO_WINDOW_BY_DEFAULT,
}
_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})


def _first(config: dict[str, Any], *keys: str, default: object = None) -> Any:
    """The value of the first of ``keys`` that ``config`` sets to something other than null."""
    return next((config[key] for key in keys if config.get(key) is not None), default)


def _windows(config: dict[str, Any], num_layers: object, name: str) -> tuple[int | None, tuple[int, ...]]:
    """``(sliding_window, sliding_layers)`` as transformers reads them.

    ``layer_types`` names each layer's kind; without it ``sliding_window_pattern``
    N makes every N-th layer global (Gemma 2/3); Qwen2-style ``use_sliding_window``
    windows the layers from ``max_window_layers`` on; otherwise a ``sliding_window``
    applies to every layer (Mistral v0.1, Phi-3) unless ``use_sliding_window`` is false.
    """
    if not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers <= 0:
        return None, ()  # ModelArch reports the bad layer count
    window = config.get("sliding_window")
    if not window or config.get("use_sliding_window") is False:
        window = None
    types = config.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != num_layers:
            raise InvalidParameterError("config", f"{name}: layer_types must list one kind per layer "
                                        f"({num_layers}), got {types!r}")
        unknown = sorted({str(t) for t in types} - _LAYER_TYPES)
        if unknown:
            raise InvalidParameterError("config", f"{name}: layer types {unknown} are not supported "
                                        f"(supported: {', '.join(sorted(_LAYER_TYPES))})")
        sliding = tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")
        if sliding and window is None:
            raise InvalidParameterError("config", f"{name}: layer_types has sliding_attention layers "
                                        "but no sliding_window")
        return (window, sliding) if sliding else (None, ())
    if window is None:
        return None, ()
    pattern = config.get("sliding_window_pattern")
    if pattern is not None:
        if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern <= 0:
            raise InvalidParameterError("config", f"{name}: sliding_window_pattern must be a positive "
                                        f"integer, got {pattern!r}")
        return window, windowed_layers(num_layers, pattern)
    first = config.get("max_window_layers")
    if config.get("use_sliding_window") and isinstance(first, int) and not isinstance(first, bool):
        return window, tuple(range(max(first, 0), num_layers))
    return window, tuple(range(num_layers))


def model_from_hf_config(config: dict[str, Any], name: str = "config") -> ModelArch:
    """Build a :class:`ModelArch` from a parsed Hugging Face ``config.json``.

    ``num_key_value_heads`` defaults to ``num_attention_heads`` (plain MHA),
    ``head_dim`` to ``hidden_size / num_attention_heads``, and
    ``tie_word_embeddings`` to False (the Llama, Mistral and Qwen2 default;
    True for Gemma). Multimodal configs that nest the language model under
    ``text_config`` work too (only the language model is counted).

    Experts: ``num_experts`` (Qwen) or ``num_local_experts`` (Mixtral),
    ``num_experts_per_tok``, ``moe_intermediate_size`` (default
    ``intermediate_size``, Mixtral's convention), ``shared_expert_intermediate_size``,
    ``decoder_sparse_step`` and ``mlp_only_layers``. Sliding windows:
    ``layer_types``, ``sliding_window``, ``sliding_window_pattern``,
    ``use_sliding_window`` (see :func:`_windows`). What configs leave to the
    model type comes from it: per-head q/k norms (Qwen3, Gemma 3), Gemma's four
    norms per layer, Qwen2's q/k/v biases, Gemma 3's vocabulary and window
    pattern, and Qwen's windows being off unless ``use_sliding_window`` says so.
    """
    if not isinstance(config, dict):
        raise InvalidParameterError("config", "config.json must hold a JSON object")
    if "num_hidden_layers" not in config and isinstance(config.get("text_config"), dict):
        config = {**config, **config["text_config"]}
    model_type = str(config.get("model_type"))
    config = {**_MODEL_TYPE_DEFAULTS.get(model_type, {}), **config}
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
    num_experts = _first(config, "num_experts", "num_local_experts", default=0)
    moe: dict[str, Any] = {}
    if num_experts:
        dense_layers = config.get("mlp_only_layers") or []
        if not isinstance(dense_layers, list):
            raise InvalidParameterError("config", f"{name}: mlp_only_layers must be a list of layer "
                                        f"indices, got {dense_layers!r}")
        moe = {
            "num_experts": num_experts,
            "num_experts_per_tok": _first(config, "num_experts_per_tok", default=0),
            "moe_intermediate_size": _first(config, "moe_intermediate_size", "intermediate_size"),
            "shared_expert_intermediate_size": _first(config, "shared_expert_intermediate_size", default=0),
            "decoder_sparse_step": _first(config, "decoder_sparse_step", default=1),
            "mlp_only_layers": tuple(dense_layers),
        }
    window, sliding = _windows(config, config["num_hidden_layers"], name)
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
        attention_bias=bool(bias) if bias is not None else model_type in _QKV_BIAS_TYPES,
        qk_norm=model_type in _QK_NORM_TYPES,
        norms_per_layer=4 if model_type in _SANDWICH_NORM_TYPES else 2,
        sliding_window=window,
        sliding_layers=sliding,
        **moe,
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
