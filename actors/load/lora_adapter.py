"""A LoRA adapter in PEFT's format, read and checked: ``adapter_config.json`` + ``adapter_model.safetensors``.

PEFT saves, per adapted module, ``base_model.model.<module>.lora_A.weight``
of shape ``(r, in_features)`` and ``...lora_B.weight`` of shape
``(out_features, r)``; the module's output gains ``scaling * x @ A^T @ B^T``
with ``scaling = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with
``use_rslora``). What flotilla serves: LoRA (``peft_type`` LORA) on any of the
Llama family's seven projections or Phi-3's fused ``qkv_proj`` and
``gate_up_proj`` (``LORA_TARGETS``), rank up to the engine's ``max_lora_rank``. Anything else an adapter may carry (DoRA, trained biases,
``modules_to_save``, per-module rank or alpha patterns, ``fan_in_fan_out``,
embedding or head targets) changes what the model computes in ways these
layers do not implement, so it is refused by name rather than ignored.

Every refusal is an ``InvalidParameterError`` naming ``lora_path`` (the
file is missing, malformed or unsupported, or was trained on another base)
or ``max_lora_rank`` (the adapter's rank is above it): the API answers 400.

Files are sized before they are read: ``adapter_config.json`` above
``MAX_CONFIG_BYTES``, or weights larger than any adapter of rank up to
``max_lora_rank`` on the base model's shapes could be (``max_weight_bytes``,
from ``LoRAManager``), are refused naming the adapter, so an admin request
cannot make a replica read a huge file into memory. Then the weights file's
safetensors header alone is read, and every tensor it declares is checked
against the base model's shapes (``module_dims``) before any tensor is: a
file is read only when it holds exactly an adapter of this model.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from stat import S_ISREG

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from scheduling.errors import InvalidParameterError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20  # PEFT writes a few hundred bytes; a long target_modules list stays far below
# Widest element a safetensors tensor may have (F64): the bound holds whatever dtype the adapter was saved in.
_MAX_ELEMENT_BYTES = 8
# The safetensors header: its 8-byte length, then JSON of about 150 bytes per tensor plus optional metadata.
_HEADER_BYTES_PER_TENSOR = 512
_HEADER_BYTES_BASE = 64 << 10
# HF module name -> where its weights live in our fused layers: (our module name, part).
LORA_TARGETS: dict[str, tuple[str, str | int | None]] = {
    "q_proj": ("self_attn.qkv_proj", "q"),
    "k_proj": ("self_attn.qkv_proj", "k"),
    "v_proj": ("self_attn.qkv_proj", "v"),
    "o_proj": ("self_attn.o_proj", None),
    "gate_proj": ("mlp.gate_up_proj", 0),
    "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", None),
    # Phi-3's checkpoint fuses q/k/v and gate/up, and its adapters name the fused modules: part None is the
    # whole fused output, split into the layer's parts once its sizes are known (``LoRAManager``).
    "qkv_proj": ("self_attn.qkv_proj", None),
    "gate_up_proj": ("mlp.gate_up_proj", None),
}
FUSED_TARGETS = ("qkv_proj", "gate_up_proj")  # the names of fused checkpoints (Phi-3); the others name one part
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
# A mixture-of-experts layer's experts (Qwen's mlp.experts.N / mlp.shared_expert, Mixtral's block_sparse_moe).
_EXPERT_KEY = re.compile(r"^base_model\.model\.model\.layers\.\d+\.(mlp|block_sparse_moe)\.(experts|shared_expert)\.")
_UNSUPPORTED = {  # adapter_config.json key -> why it cannot be honoured (when set)
    "use_dora": "DoRA adapters (use_dora)",
    "modules_to_save": "modules_to_save (fully trained copies of modules)",
    "fan_in_fan_out": "fan_in_fan_out weights (Conv1D-style layers)",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "layer_replication": "layer_replication",
}


# (layer, HF module name) -> the (in, out) features of that module in the base model (a fused module's: all
# its parts'), None where the layer has no such dense projection (a mixture-of-experts layer's MLP).
ModuleDims = Callable[[int, str], tuple[int, int] | None]


@dataclass(frozen=True)
class LoRAPart:
    """One adapted projection: layer ``layer``, our ``module`` (e.g. ``self_attn.qkv_proj``) part ``part``."""

    layer: int
    module: str
    part: str | int | None
    a: torch.Tensor  # (r, in_features), float32
    b: torch.Tensor  # (out_features, r), float32, already times the adapter's scaling


@dataclass(frozen=True)
class LoRAAdapter:
    """A checked adapter's weights on the host: what the runner writes into a slot."""

    name: str
    path: Path
    rank: int
    scaling: float
    targets: tuple[str, ...]  # the HF module names it adapts, sorted
    parts: tuple[LoRAPart, ...]

    @property
    def num_bytes(self) -> int:
        return sum(p.a.numel() * p.a.element_size() + p.b.numel() * p.b.element_size() for p in self.parts)


def _refuse(path: Path, why: str) -> InvalidParameterError:
    return InvalidParameterError("lora_path", f"adapter {str(path)!r}: {why}")


def weight_bytes_bound(dims: list[tuple[int, int]], max_rank: int) -> int:
    """The largest ``adapter_model.safetensors`` an adapter of rank <= ``max_rank`` can be.

    ``dims``: the (in, out) features of every part an adapter may target (each
    layer's q, k, v, o, gate, up, down): each holds ``lora_A`` (r, in) and
    ``lora_B`` (out, r).
    """
    weights = sum(i + o for i, o in dims) * max_rank * _MAX_ELEMENT_BYTES
    return weights + _HEADER_BYTES_BASE + 2 * len(dims) * _HEADER_BYTES_PER_TENSOR


def _size(file: Path, name: str, limit: int | None) -> None:
    """Refuse ``file`` unless it is a regular file of at most ``limit`` bytes (nothing is read)."""
    try:
        stat = file.stat()
    except FileNotFoundError:
        return  # the read that follows names the missing file
    except OSError as e:
        raise InvalidParameterError("lora_path", f"adapter {name!r}: {file.name} cannot be read: "
                                                 f"{e.strerror}") from None  # fmt: skip
    if not S_ISREG(stat.st_mode):
        raise InvalidParameterError("lora_path", f"adapter {name!r}: {file.name} is not a regular file")
    if limit is not None and stat.st_size > limit:
        # The adapter's name, not its folder: the folder is the server's to know.
        raise InvalidParameterError(
            "lora_path", f"adapter {name!r}: {file.name} is {stat.st_size} bytes, more than an adapter of rank "
            f"<= max_lora_rank on this base model can hold ({limit} bytes)",
        )  # fmt: skip


def read_adapter(
    name: str, path: str | Path, *, max_rank: int, num_layers: int, max_weight_bytes: int | None = None,
    module_dims: ModuleDims | None = None,
) -> LoRAAdapter:
    """Read and check the PEFT adapter in folder ``path``.

    ``max_weight_bytes``: refuse a larger weights file before reading it (``weight_bytes_bound``).
    ``module_dims``: the base model's shapes; every tensor the file declares must fit them, checked from
    its header before any tensor is read (None: a caller without a model, which checks nothing of shapes).
    """
    folder = Path(path)
    if not folder.is_dir():
        raise _refuse(folder, "no such folder")
    _size(folder / CONFIG_FILE, name, MAX_CONFIG_BYTES)
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise _refuse(folder, f"no {CONFIG_FILE}") from None
    except (OSError, json.JSONDecodeError) as e:
        raise _refuse(folder, f"{CONFIG_FILE} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise _refuse(folder, f"{CONFIG_FILE} is not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise _refuse(folder, f"peft_type {config.get('peft_type')!r} is not LORA")
    for key, what in _UNSUPPORTED.items():
        if config.get(key):
            raise _refuse(folder, f"{what} is not supported")
    if config.get("bias", "none") != "none":
        raise _refuse(folder, f"trained biases (bias={config.get('bias')!r}) are not supported")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise _refuse(folder, f"r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise InvalidParameterError(
            "max_lora_rank", f"adapter {str(folder)!r} has rank {rank}, above max_lora_rank {max_rank}"
        )
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise _refuse(folder, f"lora_alpha must be a number, got {alpha!r}")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    _size(folder / WEIGHTS_FILE, name, max_weight_bytes)
    if module_dims is not None:
        _check_header(name, folder, rank, num_layers, module_dims)
    try:
        tensors = load_file(folder / WEIGHTS_FILE, device="cpu")
    except FileNotFoundError:
        raise _refuse(folder, f"no {WEIGHTS_FILE} (only the safetensors format is read)") from None
    except (SafetensorError, OSError, ValueError) as e:
        raise _refuse(folder, f"{WEIGHTS_FILE} is not a readable safetensors file: {e}") from None
    return LoRAAdapter(
        name=name, path=folder, rank=rank, scaling=scaling,
        targets=tuple(sorted({k.rsplit(".lora_", 1)[0].rsplit(".", 1)[-1] for k in tensors})),
        parts=_parts(folder, tensors, rank, scaling, num_layers),
    )  # fmt: skip


def _target(folder: Path, key: str, num_layers: int) -> tuple[int, str, str]:
    """(layer, HF module, "A" or "B") of tensor ``key``, refusing what flotilla does not serve."""
    m = _KEY.match(key)
    if m is None and _EXPERT_KEY.match(key):
        raise _refuse(folder, f"tensor {key!r} adapts a mixture-of-experts layer's experts: LoRA is served "
                              "on a mixture-of-experts model's attention projections only")  # fmt: skip
    if m is None:
        raise _refuse(folder, f"tensor {key!r} is not the lora_A/lora_B of a decoder layer's projection")
    layer, hf_module, which = int(m.group(1)), m.group(3), m.group(4)
    if hf_module not in LORA_TARGETS:
        raise _refuse(folder, f"adapts {hf_module!r}; flotilla serves LoRA on {', '.join(LORA_TARGETS)}")
    if layer >= num_layers:
        raise _refuse(folder, f"adapts layer {layer}, and the base model has {num_layers} layers: "
                              "it was trained on another base model")  # fmt: skip
    return layer, hf_module, which


def _check_header(name: str, folder: Path, rank: int, num_layers: int, module_dims: ModuleDims) -> None:
    """Refuse a weights file whose header declares any tensor this base model's adapter of rank ``rank``
    would not hold: lora_A must be (r, in) and lora_B (out, r) of its module's features. Reads the header
    only (its length is bounded: ``_HEADER_BYTES_BASE`` plus ``_HEADER_BYTES_PER_TENSOR`` per possible tensor)."""
    file = folder / WEIGHTS_FILE
    max_header = _HEADER_BYTES_BASE + 2 * len(LORA_TARGETS) * num_layers * _HEADER_BYTES_PER_TENSOR
    try:
        with file.open("rb") as f:
            length = int.from_bytes(f.read(8), "little")
            if length > max_header:
                raise InvalidParameterError("lora_path", f"adapter {name!r}: {WEIGHTS_FILE} has a header of "
                                                         f"{length} bytes, more than an adapter's can be")  # fmt: skip
            header = json.loads(f.read(length))
    except FileNotFoundError:
        raise _refuse(folder, f"no {WEIGHTS_FILE} (only the safetensors format is read)") from None
    except (OSError, ValueError) as e:
        raise _refuse(folder, f"{WEIGHTS_FILE} is not a readable safetensors file: {e}") from None
    if not isinstance(header, dict):
        raise _refuse(folder, f"{WEIGHTS_FILE} is not a readable safetensors file: its header is not an object")
    for key, info in header.items():
        if key == "__metadata__":
            continue
        layer, hf_module, which = _target(folder, key, num_layers)
        shape = info.get("shape") if isinstance(info, dict) else None
        dims = module_dims(layer, hf_module)
        if dims is None:
            raise InvalidParameterError(
                "lora_path", f"adapter {name!r} adapts {hf_module} in layer {layer}, which has no such dense "
                "projection (a mixture-of-experts layer's experts take no LoRA: there, adapters are served on "
                "the attention projections only)",
            )  # fmt: skip
        want = [rank, dims[0]] if which == "A" else [dims[1], rank]
        if shape != want:
            raise InvalidParameterError(
                "lora_path", f"adapter {name!r}: layer {layer} {hf_module} lora_{which} is {shape}, an adapter of "
                f"rank {rank} on this base model has {want}: it was trained on another base model or rank",
            )  # fmt: skip


def _parts(
    folder: Path, tensors: dict[str, torch.Tensor], rank: int, scaling: float, num_layers: int
) -> tuple[LoRAPart, ...]:
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        layer, hf_module, which = _target(folder, key, num_layers)
        pairs.setdefault((layer, hf_module), {})[which] = tensor
    if not pairs:
        raise _refuse(folder, f"{WEIGHTS_FILE} holds no LoRA weights")
    parts: list[LoRAPart] = []
    for (layer, hf_module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise _refuse(folder, f"layer {layer} {hf_module} has lora_{''.join(ab)} without its pair")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise _refuse(folder, f"layer {layer} {hf_module}: lora_A {tuple(a.shape)} and lora_B "
                                  f"{tuple(b.shape)} do not have rank r={rank}")  # fmt: skip
        module, part = LORA_TARGETS[hf_module]
        parts.append(LoRAPart(layer, module, part, a.float(), b.float() * scaling))
    return tuple(parts)
