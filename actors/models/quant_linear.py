"""Weight-only int8 and int4 linears on CPU through torch's own packed kernels.

int8: one symmetric scale per output channel, ``w ~ q * scale`` with ``q`` in
-128..127 (``torch.ops.aten._weight_int8pack_mm``). int4: groups of
``group_size`` along the input dim, asymmetric, ``w ~ (q - 8) * scale + zero``
with ``q`` in 0..15 (``_convert_weight_to_int4pack_for_cpu`` /
``_weight_int4pack_mm_for_cpu``; the ``- 8`` is the kernel's, checked in
``tests/actors/test_quant_linear.py``).

Both kernels are fast only with bfloat16 activations and scales (on the
2-core AVX512/AMX development VM, two threads, a 1x576 @ 960x576 product took
183 us with float32 input and scales against 23 us in bfloat16 for int8, and
525 us against 30 us for int4). So a quantized linear rounds its input activations to bfloat16, runs
the kernel with bfloat16 scales (and zeros) and casts the bfloat16 output
back to the model dtype: **activations are rounded to bfloat16 inside
quantized linears**, whatever the model dtype. The scales and zeros are
rounded to bfloat16 *before* the codes are chosen (``quantize_int8``,
``quantize_int4``), so round-to-nearest holds against the values the kernel
really uses; codes read directly from a file (GGUF, compressed-tensors) keep
their codes and have their scales rounded at packing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

KERNEL_DTYPE = torch.bfloat16
INT4_KERNEL_GROUP_SIZES = (32, 64, 128, 256)  # what _weight_int4pack_mm_for_cpu accepts
INT4_OUT_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu packs output rows 16 at a time


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scales)``: int8 codes (N, K) and bfloat16 scales (N,), symmetric per output row.

    ``|w - q * scale| <= scale / 2`` for every element (the scale is rounded to
    bfloat16 first, then the codes are rounded against it). All-zero rows get
    scale 1 and codes 0.
    """
    w = w.float()
    scales = (w.abs().amax(dim=1) / 127.0).to(KERNEL_DTYPE)
    scales = torch.where(scales == 0, torch.ones_like(scales), scales)
    q = torch.round(w / scales.float().unsqueeze(1)).clamp_(-128, 127).to(torch.int8)
    return q, scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 ``q * scale`` (the weight the int8 kernel multiplies by)."""
    return q.float() * scales.float().unsqueeze(1)


@dataclass
class Int4Codes:
    """An int4 weight before packing: ``w = (codes - 8) * scale + zero`` per group.

    ``codes`` (N, K) uint8 in 0..15; ``scales`` and ``zeros`` (N, K // group_size)
    float32. Also what direct loaders (GGUF blocks, compressed-tensors) hand to a
    layer's ``load_weight`` in place of a float tensor.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    group_size: int

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The three tensors whose rows (and groups of columns) shard together."""
        return self.codes, self.scales, self.zeros

    def dequantize(self) -> torch.Tensor:
        """float32 (N, K) with the float32 scales and zeros (before any bfloat16 rounding)."""
        return _dequantize_groups(self.codes, self.scales, self.zeros, self.group_size)


@dataclass
class Int4Staging:
    """A layer's int4 codes filling up part by part (a fused qkv or gate_up weight)."""

    codes: Int4Codes
    arrived: set[str | int | None]

    @property
    def group_size(self) -> int:
        return self.codes.group_size

    @classmethod
    def allocate(cls, out_features: int, in_features: int, group_size: int) -> Int4Staging:
        groups = in_features // group_size
        codes = Int4Codes(
            codes=torch.empty(out_features, in_features, dtype=torch.uint8),
            scales=torch.empty(out_features, groups, dtype=torch.float32),
            zeros=torch.empty(out_features, groups, dtype=torch.float32),
            group_size=group_size,
        )
        return cls(codes=codes, arrived=set())


def _dequantize_groups(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int) -> torch.Tensor:
    n, k = codes.shape
    q = codes.float().view(n, k // group, group) - 8.0
    return (q * scales.float().unsqueeze(-1) + zeros.float().unsqueeze(-1)).view(n, k)


def quantize_int4(w: torch.Tensor, group_size: int) -> Int4Codes:
    """Asymmetric round-to-nearest int4 of ``w`` (N, K) in groups of ``group_size`` along K.

    Per group: ``scale = (max - min) / 15`` and ``zero = min + 8 * scale``, both
    rounded to bfloat16 (the kernel's), then ``codes = round((w - zero) / scale) + 8``
    clamped to 0..15. A constant group gets scale 0 and codes 8.
    """
    n, k = w.shape
    assert k % group_size == 0, f"in_features {k} is not a multiple of group_size {group_size}"
    g = w.float().view(n, k // group_size, group_size)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scales = ((hi - lo) / 15.0).to(KERNEL_DTYPE).float()
    zeros = (lo + 8.0 * scales).to(KERNEL_DTYPE).float()
    safe = torch.where(scales == 0, torch.ones_like(scales), scales)
    codes = torch.round((g - zeros.unsqueeze(-1)) / safe.unsqueeze(-1)) + 8.0
    codes = codes.clamp_(0, 15).to(torch.uint8).view(n, k)
    return Int4Codes(codes=codes, scales=scales, zeros=zeros, group_size=group_size)


class Int8Linear(nn.Module):
    """``y = x @ (q * scale)^T`` with int8 ``q`` (N, K) and a bfloat16 scale per output row.

    Also an embedding table (``embed``): a tied lm_head and embedding share one.
    """

    def __init__(self, q: torch.Tensor, scales: torch.Tensor) -> None:
        super().__init__()
        assert q.dtype == torch.int8 and scales.shape == (q.shape[0],)
        self.out_features, self.in_features = q.shape
        self.qweight: torch.Tensor
        self.scales: torch.Tensor
        self.register_buffer("qweight", q.contiguous())
        self.register_buffer("scales", scales.to(KERNEL_DTYPE).contiguous())

    @classmethod
    def from_float(cls, w: torch.Tensor) -> Int8Linear:
        return cls(*quantize_int8(w))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int8pack_mm(x.to(KERNEL_DTYPE), self.qweight, self.scales)
        return y.to(x.dtype)

    def embed(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` of the table, ``q * scale`` in ``dtype``: what the head multiplies by."""
        return F.embedding(ids, self.qweight).to(dtype) * self.scales[ids].to(dtype).unsqueeze(-1)

    def dequantize(self) -> torch.Tensor:
        return dequantize_int8(self.qweight, self.scales)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per channel"


class Int4Linear(nn.Module):
    """``y = x @ W^T`` with ``W`` int4 in groups of ``group_size`` (torch's CPU int4 packing)."""

    def __init__(self, codes: Int4Codes) -> None:
        super().__init__()
        n, k = codes.shape
        self.out_features, self.in_features, self.group_size = n, k, codes.group_size
        self.packed: torch.Tensor
        self.scales_and_zeros: torch.Tensor
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.codes.to(torch.int32).contiguous(), 1)
        # The kernel's layout: (K // group_size, N, 2) of (scale, zero).
        sz = torch.stack([codes.scales.t(), codes.zeros.t()], dim=-1).to(KERNEL_DTYPE).contiguous()
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", sz)

    @classmethod
    def from_float(cls, w: torch.Tensor, group_size: int) -> Int4Linear:
        return cls(quantize_int4(w, group_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(KERNEL_DTYPE), self.packed, self.group_size, self.scales_and_zeros
        )
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 group {self.group_size}"


QuantizedLinear = Int8Linear | Int4Linear
