"""Dequantize GGUF tensors to float32 with torch, block layout by block layout.

The layouts are ggml's (``ggml-common.h``): every block starts or ends with
fp16 scale(s) and packs its quants little-end first. Each function takes the
raw ``uint8`` rows of one tensor, shape ``(rows, bytes_per_row)``, and returns
``(rows, elements_per_row)`` float32. They are checked against the ``gguf``
package's numpy reference (``gguf.quants.dequantize``) and against
transformers' own GGUF load in ``tests/actors/load/test_gguf.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from actors.load.gguf.reader import GGUFError, GGUFTensor, block_layout


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 at byte ``start`` of every block, as float32 of shape ``(n, 1)``."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """``(n, k)`` bytes -> ``(n, 2k)``: the k low nibbles, then the k high ones (ggml's order)."""
    return torch.cat([packed & 0x0F, packed >> 4], dim=-1)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    # d: f16, qs: 32 x int8
    return _f16(blocks, 0) * blocks[:, 2:34].contiguous().view(torch.int8).float()


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    # d: f16, qs: 16 bytes of 4-bit quants, offset by 8
    return _f16(blocks, 0) * (_nibbles(blocks[:, 2:18]).float() - 8.0)


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    # d: f16, m: f16, qs: 16 bytes of 4-bit quants; x = d * q + m
    return _f16(blocks, 0) * _nibbles(blocks[:, 4:20]).float() + _f16(blocks, 2)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    # 256 values in 8 sub-blocks of 32. d, dmin: f16; scales: 12 bytes holding eight
    # 6-bit scales and eight 6-bit mins; qs: 128 bytes, each 32-byte run holding two
    # sub-blocks (low nibbles first). x = d * scale * q - dmin * min.
    n = blocks.shape[0]
    d, dmin = _f16(blocks, 0).view(n, 1, 1), _f16(blocks, 2).view(n, 1, 1)
    s = blocks[:, 4:16].to(torch.int32)
    scales = torch.cat([s[:, 0:4] & 63, (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)], dim=1)
    mins = torch.cat([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], dim=1)
    qs = blocks[:, 16:144].reshape(n, 4, 32)
    q = torch.stack([qs & 0x0F, qs >> 4], dim=2).reshape(n, 8, 32).float()
    x = d * scales.view(n, 8, 1).float() * q - dmin * mins.view(n, 8, 1).float()
    return x.reshape(n, 256)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    # 256 values in two halves of 128. ql: 128 bytes (low 4 bits), qh: 64 bytes (high 2
    # bits, four values per byte), scales: 16 x int8 (one per 16 values), d: f16.
    n = blocks.shape[0]
    ql = blocks[:, 0:128].reshape(n, 2, 64).to(torch.int32)
    qh = blocks[:, 128:192].reshape(n, 2, 32).to(torch.int32)
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()
    d = _f16(blocks, 208)
    lo, hi = ql[..., :32], ql[..., 32:]
    q = torch.stack(
        [
            (lo & 0x0F) | ((qh & 3) << 4),
            (hi & 0x0F) | (((qh >> 2) & 3) << 4),
            (lo >> 4) | (((qh >> 4) & 3) << 4),
            (hi >> 4) | (((qh >> 6) & 3) << 4),
        ],
        dim=2,
    ).reshape(n, 256).float() - 32.0
    return d * scales.repeat_interleave(16, dim=1) * q


_BLOCK_DEQUANT: dict[T, Callable[[torch.Tensor], torch.Tensor]] = {
    T.Q8_0: _q8_0,
    T.Q4_0: _q4_0,
    T.Q4_1: _q4_1,
    T.Q4_K: _q4_k,
    T.Q6_K: _q6_k,
}
_FLOAT_TYPES = (T.F32, T.F16, T.BF16)

SUPPORTED_TYPES: tuple[str, ...] = tuple(t.name for t in (*_FLOAT_TYPES, *_BLOCK_DEQUANT))


def check_supported(tensor: GGUFTensor) -> None:
    """Raise ``GGUFError`` naming the tensor and its type unless ``dequantize`` handles it."""
    if tensor.qtype not in _FLOAT_TYPES and tensor.qtype not in _BLOCK_DEQUANT:
        raise GGUFError(
            f"tensor {tensor.name!r} is stored as GGML type {tensor.type_name}, which flotilla cannot "
            f"dequantize; supported types: {', '.join(SUPPORTED_TYPES)}"
        )


def dequantize(tensor: GGUFTensor) -> torch.Tensor:
    """``tensor`` as a float32 torch tensor of ``tensor.shape`` (a fresh copy, not a file view)."""
    check_supported(tensor)
    raw = np.ascontiguousarray(tensor.raw)
    if tensor.qtype in (T.F32, T.F16):
        return torch.from_numpy(raw.copy()).float().reshape(tensor.shape)
    rows = torch.from_numpy(raw.reshape(-1, raw.shape[-1]).copy())
    if tensor.qtype == T.BF16:
        return rows.view(torch.bfloat16).float().reshape(tensor.shape)
    per_block, block_bytes = block_layout(tensor.qtype)
    if tensor.shape[-1] % per_block:
        raise GGUFError(f"tensor {tensor.name!r}: row length {tensor.shape[-1]} is not a multiple of "
                        f"the {tensor.type_name} block size {per_block}")
    blocks = rows.reshape(-1, block_bytes)
    return _BLOCK_DEQUANT[tensor.qtype](blocks).reshape(tensor.shape)
