"""A checkpoint's Hugging Face config turned into the numbers the shared decoder is built from.

Every family parses its config through ``common_args`` (plus what it adds or
overrides) into one ``DecoderArgs``; anything a family does not implement is
refused by name (``refuse``), with what is supported.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from transformers import AutoConfig, PretrainedConfig

from actors.models.moe import MoEArgs
from scheduling.errors import InvalidParameterError

HFConfig = PretrainedConfig | Mapping[str, Any]
Activation = Literal["silu", "gelu_tanh"]
NormKind = Literal["rms", "gemma"]


def config_get(config: HFConfig, key: str, default: Any = None) -> Any:
    """Read ``key`` from a ``PretrainedConfig`` or its ``config.json`` dict."""
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


def as_pretrained(config: HFConfig) -> PretrainedConfig:
    """``config`` as transformers normalises it (derived fields such as ``layer_types`` filled in)."""
    if isinstance(config, PretrainedConfig):
        return config
    fields = dict(config)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def refuse(feature: str, family: str, supported: str) -> InvalidParameterError:
    """The error for a config feature a family does not implement: names it and what is supported."""
    return InvalidParameterError("model", f"{family}: {feature} is not supported (supported: {supported})")


@dataclass(frozen=True)
class RopeArgs:
    """One RoPE table: its base and HF scaling dict (None: default rotary)."""

    theta: float
    scaling: dict[str, Any] | None


def rope_from(params: Mapping[str, Any] | None, default_theta: float = 10000.0) -> RopeArgs:
    """A ``RopeArgs`` from an HF ``rope_parameters`` / ``rope_scaling`` dict (either transformers layout)."""
    rope = dict(params or {})
    theta = float(rope.pop("rope_theta", None) or default_theta)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if float(rope.pop("partial_rotary_factor", None) or 1.0) != 1.0:
        raise InvalidParameterError("model", "partial rotary embeddings are not supported")
    return RopeArgs(theta, None if rope_type in (None, "default") else rope)


def layer_windows(config: HFConfig, num_layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window (keys a query sees, itself included), None for global attention.

    ``layer_types`` (transformers 5, Gemma 3, Qwen2/3) names each layer's kind;
    without it a ``sliding_window`` applies to every layer (Mistral, Mixtral,
    Phi-3, Qwen3-MoE), unless ``use_sliding_window`` is false. Qwen configs keep
    a window number (or 0) around when windows are off.
    """
    g = config_get
    window = g(config, "sliding_window", None)
    if not window or not g(config, "use_sliding_window", True):
        window = None
    types = g(config, "layer_types", None)
    if types is None:
        return (None if window is None else int(window),) * num_layers
    if len(types) != num_layers:
        raise InvalidParameterError("model", f"layer_types has {len(types)} entries for {num_layers} layers")
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise InvalidParameterError(
            "model", f"layer types {unknown} are not supported (supported: full_attention, sliding_attention)"
        )
    if window is None and "sliding_attention" in types:
        raise InvalidParameterError("model", "layer_types has sliding_attention layers but no sliding_window")
    return tuple(int(window) if t == "sliding_attention" and window else None for t in types)


@dataclass(frozen=True)
class DecoderArgs:
    """The architecture numbers of one checkpoint, normalised; families fill in what differs from Llama.

    ``layer_windows[i]``: layer ``i``'s sliding window (None: global).
    ``local_rope``: the RoPE of windowed layers when it differs (Gemma 3's
    local base); ``rope`` serves every other layer. ``moe_layers``: the
    layers whose feed-forward is ``moe``'s mixture of experts.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeArgs
    max_position_embeddings: int
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    layer_windows: tuple[int | None, ...]
    qk_norm: bool = False
    norm: NormKind = "rms"
    act: Activation = "silu"
    sandwich_norms: bool = False  # Gemma: norms after attention and around the MLP too
    embed_scale: float | None = None  # Gemma: embeddings times sqrt(hidden)
    attn_scale: float | None = None  # None: head_dim ** -0.5
    local_rope: RopeArgs | None = None
    final_logit_softcap: float | None = None
    moe: MoEArgs | None = None
    moe_layers: frozenset[int] = frozenset()


def common_args(config: HFConfig, family: str, **fields: Any) -> DecoderArgs:
    """The fields every family reads the same way; ``fields`` add to or override them."""
    g = config_get
    hidden, heads = int(g(config, "hidden_size")), int(g(config, "num_attention_heads"))
    act = g(config, "hidden_act", "silu")
    if "act" not in fields and act not in ("silu", "swish"):
        raise refuse(f"hidden_act {act!r}", family, "silu")
    num_layers = int(g(config, "num_hidden_layers"))
    if float(g(config, "partial_rotary_factor", None) or 1.0) != 1.0:
        raise refuse("partial rotary embeddings (partial_rotary_factor)", family, "rotary over the whole head")
    # transformers 5 folds rope_theta and rope_scaling into rope_parameters;
    # config.json files written by transformers 4 keep them apart.
    rope_params = g(config, "rope_parameters", None) or g(config, "rope_scaling", None)
    base: dict[str, Any] = {
        "vocab_size": int(g(config, "vocab_size")),
        "hidden_size": hidden,
        "intermediate_size": int(g(config, "intermediate_size")),
        "num_layers": num_layers,
        "num_heads": heads,
        "num_kv_heads": int(g(config, "num_key_value_heads", None) or heads),
        "head_dim": int(g(config, "head_dim", None) or hidden // heads),
        "rms_norm_eps": float(g(config, "rms_norm_eps", 1e-6)),
        "rope": rope_from(rope_params, float(g(config, "rope_theta", None) or 10000.0)),
        "max_position_embeddings": int(g(config, "max_position_embeddings", 2048)),
        "qkv_bias": bool(g(config, "attention_bias", False)),
        "o_bias": bool(g(config, "attention_bias", False)),
        "mlp_bias": bool(g(config, "mlp_bias", False)),
        "tie_word_embeddings": bool(g(config, "tie_word_embeddings", False)),
        "layer_windows": layer_windows(config, num_layers),
    }
    return DecoderArgs(**{**base, **fields})
