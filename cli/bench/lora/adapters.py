"""Seeded random LoRA adapters in PEFT's format, for a Llama-family model folder, written without ``peft``.

``bench lora`` needs adapters of the right shapes, not trained ones: their
cost in a step depends on the rank and the projections adapted, not on the
values. Each adapter folder holds what PEFT's ``save_pretrained`` writes and
``actors.load.lora_adapter`` reads: ``adapter_config.json`` and
``adapter_model.safetensors`` with, per decoder layer and projection,
``base_model.model.model.layers.{L}.{self_attn|mlp}.{proj}.lora_A.weight``
``(r, in_features)`` and ``...lora_B.weight`` ``(out_features, r)``. The
shapes come from the model's ``config.json``. Every A and B is ``scale *
N(0, 1)`` from a generator seeded per adapter: B is not zero (PEFT's own
initialisation), so each adapter really changes the model's output.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from actors.load.lora_adapter import CONFIG_FILE, FUSED_TARGETS, LORA_TARGETS, WEIGHTS_FILE
from scheduling.errors import InvalidParameterError

ALL_PROJECTIONS: tuple[str, ...] = tuple(t for t in LORA_TARGETS if t not in FUSED_TARGETS)  # q, k, v, o, gate, up, down
DEFAULT_SCALE = 0.02  # std of every A and B entry: deltas well under the base's outputs, logits stay finite


@dataclass(frozen=True, slots=True)
class ProjectionShapes:
    """The decoder layers' count and each projection's ``(in_features, out_features)``."""

    num_layers: int
    features: dict[str, tuple[int, int]]

    @classmethod
    def of(cls, model_dir: Path) -> ProjectionShapes:
        """Read ``model_dir/config.json`` (Hugging Face Llama keys)."""
        path = model_dir / "config.json"
        try:
            config = json.loads(path.read_text())
            hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
            kv_heads = int(config.get("num_key_value_heads") or heads)
            head_dim = int(config.get("head_dim") or hidden // heads)
            inter, layers = int(config["intermediate_size"]), int(config["num_hidden_layers"])
        except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise InvalidParameterError("model", f"{str(path)!r} is not a Llama-family config.json: "
                                                 f"{type(e).__name__}: {e}") from None
        q, kv = heads * head_dim, kv_heads * head_dim
        return cls(layers, {
            "q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden),
        })  # fmt: skip


def _group(projection: str) -> str:
    return "self_attn" if projection in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"


def write_adapter(shapes: ProjectionShapes, out_dir: Path, *, rank: int, alpha: float, seed: int,
                  targets: tuple[str, ...] = ALL_PROJECTIONS, scale: float = DEFAULT_SCALE) -> Path:
    """One adapter of rank ``rank`` on ``targets`` of every layer into ``out_dir`` (created); returns it."""
    if rank < 1:
        raise InvalidParameterError("rank", f"must be >= 1, got {rank}")
    unknown = [t for t in targets if t not in shapes.features]
    if unknown or not targets:
        raise InvalidParameterError("targets", f"must be some of {', '.join(ALL_PROJECTIONS)}, got {targets!r}")
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(shapes.num_layers):
        for proj in targets:
            in_f, out_f = shapes.features[proj]
            key = f"base_model.model.model.layers.{layer}.{_group(proj)}.{proj}"
            tensors[f"{key}.lora_A.weight"] = scale * torch.randn(rank, in_f, generator=gen)
            tensors[f"{key}.lora_B.weight"] = scale * torch.randn(out_f, rank, generator=gen)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / WEIGHTS_FILE))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets),
              "bias": "none", "lora_dropout": 0.0, "task_type": "CAUSAL_LM"}
    (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


def write_adapters(model_dir: Path, out_dir: Path, count: int, *, rank: int, seed: int = 0,
                   targets: tuple[str, ...] = ALL_PROJECTIONS, scale: float = DEFAULT_SCALE) -> list[Path]:
    """``count`` adapters ``out_dir/adapter-{i}`` (seed ``seed + i``, ``lora_alpha = 2 * rank``)."""
    shapes = ProjectionShapes.of(model_dir)
    return [write_adapter(shapes, out_dir / f"adapter-{i}", rank=rank, alpha=2.0 * rank, seed=seed + i,
                          targets=targets, scale=scale) for i in range(count)]
