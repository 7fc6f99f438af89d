"""Load GPTQ/AWQ checkpoints saved in compressed-tensors' ``pack-quantized`` format as int4.

Such a checkpoint (``config.json`` has ``quantization_config`` with
``quant_method: "compressed-tensors"``, as llm-compressor writes it) stores
each quantized linear as ``weight_packed`` (int32, eight 4-bit values a
word), ``weight_scale`` (N, K / group), ``weight_shape`` and, when
asymmetric, ``weight_zero_point`` (4-bit, packed along the output dim). The
package's ``QuantizationConfig`` parses the config and its
``unpack_from_int32`` unpacks the words into signed codes ``q`` in -8..7 with
``w = (q - zp) * scale``. The int4 kernel computes ``(c - 8) * scale + zero``
with ``c`` in 0..15, so ``c = q + 8`` and ``zero = -zp * scale``: the codes
are the checkpoint's, never dequantized to floats. Modules in the config's
``ignore`` list (typically ``lm_head``) are stored as plain weights and stay
float.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from pydantic import ValidationError

from actors.models.quant_linear import INT4_KERNEL_GROUP_SIZES, Int4Codes
from scheduling.errors import InvalidParameterError

if TYPE_CHECKING:
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme

QUANT_METHOD = "compressed-tensors"
PACKED_FORMAT = "pack-quantized"
_PARTS = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx")


@dataclass(frozen=True)
class CompressedTensorsScheme:
    """What flotilla needs of a compressed-tensors config: 4-bit int weights in groups."""

    group_size: int
    symmetric: bool
    ignore: tuple[str, ...]

    def describe(self) -> str:
        kind = "symmetric" if self.symmetric else "with zero points"
        return f"int4, group {self.group_size}, compressed-tensors {kind}"


def _unsupported(why: str) -> InvalidParameterError:
    return InvalidParameterError("model", f"this compressed-tensors checkpoint is not supported: {why}")


def _value(x: Any) -> str | None:
    """An enum field's string (the package keeps enum values, but may keep members)."""
    return None if x is None else str(getattr(x, "value", x))


def _format_of(config: QuantizationConfig, scheme: QuantizationScheme) -> str | None:
    return _value(scheme.format if scheme.format is not None else config.format)


def read_scheme(quantization_config: Mapping[str, Any]) -> CompressedTensorsScheme:
    """Parse ``config.json``'s ``quantization_config``; ``InvalidParameterError`` (``model``) for
    anything but weight-only 4-bit integer groups in the ``pack-quantized`` format."""
    # Imported here, not at the top: the package pulls in torch._dynamo (a slow import),
    # which every process that imports the loader would pay for checkpoints that are not
    # compressed-tensors ones.
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme

    try:
        config = QuantizationConfig.model_validate(dict(quantization_config))
    except (ValidationError, ValueError) as e:
        raise _unsupported(f"its quantization_config does not parse ({e})") from e
    if config.kv_cache_scheme is not None:
        raise _unsupported("it quantizes the KV cache (kv_cache_scheme)")
    found: set[tuple[int, bool]] = set()
    for name, scheme in config.config_groups.items():
        assert isinstance(scheme, QuantizationScheme)  # model_post_init expanded presets
        w = scheme.weights
        if scheme.input_activations is not None or scheme.output_activations is not None:
            raise _unsupported(f"group {name!r} quantizes activations; only weight-only schemes load")
        if _format_of(config, scheme) != PACKED_FORMAT:
            raise _unsupported(f"group {name!r} is stored as {_format_of(config, scheme)!r}, not {PACKED_FORMAT!r}")
        if w is None or w.num_bits != 4 or _value(w.type) != "int":
            raise _unsupported(f"group {name!r} is not 4-bit integer weights")
        if _value(w.strategy) != "group" or w.group_size is None:
            raise _unsupported(f"group {name!r} uses strategy {w.strategy!r}; only 'group' loads")
        if w.group_size not in INT4_KERNEL_GROUP_SIZES:
            raise _unsupported(f"group size {w.group_size} (the int4 kernel takes {INT4_KERNEL_GROUP_SIZES})")
        if w.dynamic:
            raise _unsupported(f"group {name!r} has dynamic weight quantization")
        found.add((int(w.group_size), bool(w.symmetric)))
    if len(found) != 1:
        raise _unsupported(f"expected one weight scheme, found {sorted(found) or 'none'}")
    (group_size, symmetric), = found
    return CompressedTensorsScheme(group_size=group_size, symmetric=symmetric, ignore=tuple(config.ignore or ()))


def to_codes(parts: Mapping[str, torch.Tensor], scheme: CompressedTensorsScheme) -> Int4Codes:
    """One module's packed tensors as ``Int4Codes``."""
    # Imported here for the reason given in read_scheme (which has always run first).
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    shape = torch.Size(int(d) for d in parts["weight_shape"].tolist())
    signed = unpack_from_int32(parts["weight_packed"], 4, shape)  # int8 in -8..7
    codes = (signed.to(torch.int16) + 8).to(torch.uint8)
    scales = parts["weight_scale"].float()
    n, k = shape
    if k % scheme.group_size or tuple(scales.shape) != (n, k // scheme.group_size):
        raise _unsupported(f"weight_scale of shape {tuple(scales.shape)} does not match weight_shape "
                           f"{tuple(shape)} in groups of {scheme.group_size}")
    if scheme.symmetric:
        zeros = torch.zeros_like(scales)
    else:
        zp = unpack_from_int32(parts["weight_zero_point"], 4, scales.shape, packed_dim=0)
        zeros = -zp.float() * scales
    return Int4Codes(codes=codes, scales=scales, zeros=zeros, group_size=scheme.group_size)


def iter_int4_weights(
    weights: Iterable[tuple[str, torch.Tensor]], scheme: CompressedTensorsScheme
) -> Iterator[tuple[str, torch.Tensor | Int4Codes]]:
    """Pass plain tensors through; turn each module's packed tensors into ``(name.weight, Int4Codes)``.

    A module's parts may arrive in any order (and across shard files); it is
    yielded once all have. A part left over at the end is an error naming ``model``.
    """
    needed = {"weight_packed", "weight_scale", "weight_shape"} | (set() if scheme.symmetric else {"weight_zero_point"})
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        prefix, _, leaf = name.rpartition(".")
        if leaf not in _PARTS:
            yield name, tensor
            continue
        if leaf == "weight_g_idx":
            raise _unsupported(f"{name} holds an activation-order permutation (GPTQ act-order), "
                               "which the int4 kernel cannot apply")
        parts = pending.setdefault(prefix, {})
        parts[leaf] = tensor
        if needed <= parts.keys():
            yield f"{prefix}.weight", to_codes(pending.pop(prefix), scheme)
    if pending:
        prefix, parts = next(iter(pending.items()))
        raise _unsupported(f"{prefix} lacks {sorted(needed - parts.keys())} ({len(pending)} modules incomplete)")
