"""Read Q4_0 / Q4_1 blocks of a GGUF file directly as int4 codes for the int4 kernel.

A Q4_1 block holds 32 values ``x = d * q + m`` (``q`` in 0..15, fp16 ``d``
and ``m``); the int4 kernel computes ``(q - 8) * scale + zero``, so the same
codes serve with ``scale = d`` and ``zero = m + 8 * d``. Q4_0 is
``x = d * (q - 8)``: ``scale = d``, ``zero = 0``. No dequantize-requantize
round trip: the codes are the file's, in groups of 32 (``GROUP_SIZE``).

The scales and zeros are kept in float32 here (exact: sums of fp16 values).
The native int4 kernel takes ``d`` and ``m = zero - 8d`` in float16, exactly
the file's; torch's kernel (no native kernel) rounds them to bfloat16.

The embedding and LM head, when stored as Q8_0 blocks (32 int8 values and
an fp16 ``d``: ``x = d * q``), load directly too, as ``Int8Blocks`` (an int8
weight with a scale per group of 32), so ``quantization="int4"`` on a
Q4_1/Q8_0 file multiplies by exactly the file's weights. Other vocab types
are requantized to int8 per row from their dequantized floats.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from gguf import GGMLQuantizationType as T

from actors.load.gguf.archs import (
    GGUF_LAYER_NAMES,
    gguf_architecture,
    permuted_heads,
    unpermute_rows,
)
from actors.load.gguf.reader import GGUFError, GGUFFile, GGUFTensor, block_layout
from actors.models.decoder import FUSED_CHECKPOINT_NAMES
from actors.models.quant_linear import Int4Codes, Int8Blocks

GROUP_SIZE = 32  # values per Q4_0 / Q4_1 / Q8_0 block
DIRECT_TYPES = (T.Q4_0, T.Q4_1)
DIRECT_VOCAB_TYPES = (T.Q8_0,)
_VOCAB_TENSORS = ("token_embd.weight", "output.weight")
# llama.cpp names of the linear weights (the projections, not norms or embeddings).
_LINEAR_SUFFIXES = tuple(k for k, v in GGUF_LAYER_NAMES.items() if v.endswith("_proj.weight"))


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _blocks(tensor: GGUFTensor, types: tuple[T, ...], names: str) -> torch.Tensor:
    """The tensor's raw blocks (one row of bytes per block of ``GROUP_SIZE`` values); its type must be in ``types``."""
    if tensor.qtype not in types:
        raise GGUFError(f"tensor {tensor.name!r} is {tensor.type_name}, not {names}")
    per_block, block_bytes = block_layout(tensor.qtype)
    assert per_block == GROUP_SIZE
    return torch.from_numpy(tensor.raw.reshape(-1, block_bytes).copy())


def q4_codes(tensor: GGUFTensor) -> Int4Codes:
    """The codes, scales and zeros of a Q4_0 or Q4_1 tensor (rows as stored: not un-permuted)."""
    blocks = _blocks(tensor, DIRECT_TYPES, "Q4_0 or Q4_1")
    rows, k = tensor.shape
    qs_start = 2 if tensor.qtype == T.Q4_0 else 4
    qs = blocks[:, qs_start : qs_start + GROUP_SIZE // 2]
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1)  # ggml's order: low nibbles, then high
    d = _f16(blocks, 0)
    zero = torch.zeros_like(d) if tensor.qtype == T.Q4_0 else _f16(blocks, 2) + 8.0 * d
    groups = k // GROUP_SIZE
    return Int4Codes(
        codes=codes.reshape(rows, k),
        scales=d.reshape(rows, groups),
        zeros=zero.reshape(rows, groups),
        group_size=GROUP_SIZE,
    )


def q8_blocks(tensor: GGUFTensor) -> Int8Blocks:
    """The int8 values and fp16 scales (as float32, exact) of a Q8_0 tensor."""
    blocks = _blocks(tensor, DIRECT_VOCAB_TYPES, "Q8_0")
    rows, k = tensor.shape
    codes = blocks[:, 2:].contiguous().view(torch.int8)
    return Int8Blocks(codes=codes.reshape(rows, k), scales=_f16(blocks, 0).reshape(rows, k // GROUP_SIZE),
                      group_size=GROUP_SIZE)


def _fused_key(name: str) -> str:
    for hf_part, (ours, _) in FUSED_CHECKPOINT_NAMES.items():
        if hf_part in name:
            return name.replace(hf_part, ours)
    return name


def direct_int4_tensors(g: GGUFFile) -> dict[str, GGUFTensor]:
    """Hugging Face name -> tensor, for every linear weight whose blocks load directly.

    A fused layer (qkv, gate_up) loads directly only when every part of it is
    Q4_0/Q4_1: otherwise all its parts take the float route, so one layer
    never mixes codes read from the file with codes requantized from floats.
    """
    hf_name = gguf_architecture(g).hf_name
    linear = {hf_name(t.name): t for t in g.tensors.values() if t.name.endswith(_LINEAR_SUFFIXES)}
    by_layer: dict[str, list[str]] = {}
    for name in linear:
        by_layer.setdefault(_fused_key(name), []).append(name)
    return {
        name: linear[name]
        for names in by_layer.values()
        if all(linear[n].qtype in DIRECT_TYPES for n in names)
        for name in names
    }


def direct_vocab_tensors(g: GGUFFile) -> dict[str, GGUFTensor]:
    """Hugging Face name -> tensor, for the embedding and LM head if stored as Q8_0 blocks."""
    hf_name = gguf_architecture(g).hf_name
    return {hf_name(name): g.tensors[name] for name in _VOCAB_TENSORS
            if name in g.tensors and g.tensors[name].qtype in DIRECT_VOCAB_TYPES}


def iter_int4_weights(
    tensors: dict[str, GGUFTensor], *, num_heads: int, num_kv_heads: int, permuted_qk: bool
) -> Iterator[tuple[str, Int4Codes | Int8Blocks]]:
    """``(hf_name, Int4Codes)`` for the linears of ``tensors`` (``direct_int4_tensors``), and ``(hf_name,
    Int8Blocks)`` for its vocab tensors (``direct_vocab_tensors``). ``permuted_qk``: the file's architecture
    has llama.cpp's Q/K row permutation (``GGUFArchitecture.permuted_qk``), undone here."""
    for name, tensor in tensors.items():
        if tensor.qtype in DIRECT_VOCAB_TYPES:
            yield name, q8_blocks(tensor)
            continue
        codes = q4_codes(tensor)
        heads = permuted_heads(name, num_heads, num_kv_heads) if permuted_qk else 0
        if heads:
            c, s, z = (unpermute_rows(t, heads) for t in codes.parts())
            codes = Int4Codes(codes=c, scales=s, zeros=z, group_size=codes.group_size)
        yield name, codes
