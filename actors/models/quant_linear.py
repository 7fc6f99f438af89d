"""Weight-only int8 and int4 linears on CPU.

int8: one symmetric scale per output channel, ``w ~ q * scale`` with ``q`` in
-128..127. int4: groups of ``group_size`` along the input dim, asymmetric,
``w ~ (q - 8) * scale + zero`` with ``q`` in 0..15. The scales (int8:
bfloat16; int4: float16 ``d`` and ``m``) are rounded *before* the codes are
chosen (``quantize_int8``, ``quantize_int4``), so round-to-nearest holds
against the values the kernels use; codes read directly from a file (GGUF,
compressed-tensors) keep their codes and scales.

Two kernels, chosen once per layer when it is built:

- **native** (``kvcache/csrc/quant_gemm.cpp``, through
  ``cpu_kernels.get_quant_gemm``), whenever the extension builds and the input
  dim is a multiple of 32: the weight is dequantized in registers and
  multiplied in **float32** (from ``DEQUANT_MIN_ROWS`` rows, dequantized
  into a float32 weight for torch's GEMM instead), activations included (a bfloat16 model's
  activations are widened, and the output cast back). int4 is stored as
  nibbles with a float16 ``(d, m)`` per group, ``w = c * d + m`` with ``c =
  q`` (GGUF Q4_1's form; ``d = scale``, ``m = zero - 8 * scale``, rounded to
  float16: exact for GGUF blocks, whose d and m are float16). It runs
  SmolLM2-135M's batch-1 decode faster than torch's kernels
  (docs/quantization.md), and the outputs carry no activation rounding.
- **torch's** packed kernels otherwise (``_weight_int8pack_mm``,
  ``_weight_int4pack_mm_for_cpu``), which are fast only with bfloat16
  activations and scales (docs/design_costs.md, entry ``int8pack_dtype``):
  the input is rounded to bfloat16, the product runs with bfloat16 scales
  and zeros and the output is cast back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvcache import cpu_kernels
from scheduling.errors import InvalidParameterError

KERNEL_DTYPE = torch.bfloat16
INT4_KERNEL_GROUP_SIZES = (32, 64, 128, 256)  # what _weight_int4pack_mm_for_cpu accepts
INT4_OUT_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu packs output rows 16 at a time
NATIVE_K_MULTIPLE = 32  # the native kernels' input dim (and int4 group size) step
DEQUANT_MIN_ROWS = 32  # products of this many rows dequantize the weight and use torch's float32 GEMM


def _native_gemm(in_features: int, group_size: int | None = None) -> Any | None:
    """The native kernels' module for a layer of this shape, or None (torch's kernels then)."""
    if in_features % NATIVE_K_MULTIPLE or (group_size is not None and group_size % NATIVE_K_MULTIPLE):
        return None
    return cpu_kernels.get_quant_gemm()


def _run_native(gemm: Any, dequant: Any, x: torch.Tensor, out_features: int, *weights: Any) -> torch.Tensor:
    """``x @ W^T`` in float32 over ``x``'s rows; the result in ``x``'s shape and dtype.

    Up to ``DEQUANT_MIN_ROWS`` rows: ``gemm(out, x2d, *weights)``, which reads
    the quantized weight once. From there the product is compute-bound and
    torch's float32 GEMM is faster than the native loop (docs/design_costs.md), so
    ``dequant(w, *weights)`` writes the float32 weight and ``F.linear`` runs.
    """
    x2 = x.reshape(-1, x.shape[-1]).float().contiguous()
    if x2.shape[0] >= DEQUANT_MIN_ROWS:
        w = x2.new_empty(out_features, x2.shape[1])
        dequant(w, *weights)
        out = F.linear(x2, w)
    else:
        out = x2.new_empty(x2.shape[0], out_features)
        gemm(out, x2, *weights)
    return out.view(*x.shape[:-1], out_features).to(x.dtype)


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

    Per group: ``d = (max - min) / 15`` and ``m = min``, both rounded to
    float16 (the native kernel's ``w = q * d + m``), then ``q = round((w - m) / d)``
    clamped to 0..15; stored as ``scale = d``, ``zero = m + 8 * d`` (exact in
    float32). A constant group gets scale 0 and codes 0. Torch's kernel (no
    native kernel) rounds scale and zero to bfloat16 at packing, as for codes
    read from a file.
    """
    n, k = w.shape
    assert k % group_size == 0, f"in_features {k} is not a multiple of group_size {group_size}"
    g = w.float().view(n, k // group_size, group_size)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    d = ((hi - lo) / 15.0).to(torch.float16).float()
    m = lo.to(torch.float16).float()
    if not (torch.isfinite(d).all() and torch.isfinite(m).all()):
        raise InvalidParameterError("quantization", "int4 scales overflow float16: a weight exceeds 65504 in magnitude")
    safe = torch.where(d == 0, torch.ones_like(d), d)
    codes = torch.round((g - m.unsqueeze(-1)) / safe.unsqueeze(-1))
    codes = codes.clamp_(0, 15).to(torch.uint8).view(n, k)
    return Int4Codes(codes=codes, scales=d, zeros=m + 8.0 * d, group_size=group_size)


@dataclass
class Int8Blocks:
    """An int8 weight read from a file in groups: ``w = codes * scales`` per group of ``group_size`` columns.

    ``codes`` (N, K) int8, ``scales`` (N, K // group_size) float32 (GGUF Q8_0:
    groups of 32 with a float16 scale each). What a direct loader hands to an
    embedding's ``load_weight``; ``Int8Linear.from_blocks`` multiplies by it as is.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    group_size: int

    def rows(self, start: int, count: int) -> Int8Blocks:
        return Int8Blocks(self.codes.narrow(0, start, count), self.scales.narrow(0, start, count), self.group_size)


class Int8Linear(nn.Module):
    """``y = x @ (q * scale)^T`` with int8 ``q`` (N, K): a bfloat16 scale per output row, or float32 per group.

    Per row is what ``quantize_int8`` makes; per group (``group_size``) is an
    int8 weight read from a file as it is stored (``from_blocks``: GGUF Q8_0),
    which only the native kernel multiplies directly (without it, the weight is
    dequantized for each product: exact but slow). Also an embedding table
    (``embed``): a tied lm_head and embedding share one.
    """

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, group_size: int | None = None) -> None:
        super().__init__()
        n, k = q.shape
        assert q.dtype == torch.int8
        assert scales.shape == ((n,) if group_size is None else (n, k // group_size)), (scales.shape, group_size)
        self.out_features, self.in_features = n, k
        self.group_size = group_size
        self.qweight: torch.Tensor
        self.scales: torch.Tensor
        self.register_buffer("qweight", q.contiguous())
        scale_dtype = KERNEL_DTYPE if group_size is None else torch.float32
        self.register_buffer("scales", scales.to(scale_dtype).contiguous())
        self._native = _native_gemm(k, group_size)
        self._kernel_scales = None if self._native is None else self.scales.float().view(n, -1).contiguous()

    @classmethod
    def from_float(cls, w: torch.Tensor) -> Int8Linear:
        return cls(*quantize_int8(w))

    @classmethod
    def from_blocks(cls, blocks: Int8Blocks) -> Int8Linear:
        return cls(blocks.codes, blocks.scales, blocks.group_size)

    @property
    def float32_products(self) -> bool:
        """True when ``forward`` multiplies in float32 (the native kernel, or any per-group weight)."""
        return self._native is not None or self.group_size is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._native is not None:
            group = self.group_size or self.in_features
            native = self._native
            return _run_native(native.int8_gemm, native.int8_dequant, x, self.out_features, self.qweight,
                               self._kernel_scales, group)
        if self.group_size is not None:
            return F.linear(x.float(), self.dequantize()).to(x.dtype)
        x2 = x.reshape(-1, self.in_features).to(KERNEL_DTYPE)
        y = torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scales)
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def embed(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` of the table, ``q * scale`` in ``dtype``: what the head multiplies by."""
        rows = F.embedding(ids, self.qweight)
        if self.group_size is None:
            return rows.to(dtype) * self.scales[ids].to(dtype).unsqueeze(-1)
        grouped = rows.float().unflatten(-1, (-1, self.group_size)) * self.scales[ids].unsqueeze(-1)
        return grouped.flatten(-2).to(dtype)

    def dequantize(self) -> torch.Tensor:
        if self.group_size is None:
            return dequantize_int8(self.qweight, self.scales)
        return (self.qweight.float().unflatten(-1, (-1, self.group_size)) * self.scales.unsqueeze(-1)).flatten(-2)

    def extra_repr(self) -> str:
        per = "per channel" if self.group_size is None else f"groups of {self.group_size}"
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 {per}"


class Int4Linear(nn.Module):
    """``y = x @ W^T`` with ``W`` int4 in groups of ``group_size``: native nibbles, else torch's CPU int4 packing."""

    def __init__(self, codes: Int4Codes) -> None:
        super().__init__()
        n, k = codes.shape
        self.out_features, self.in_features, self.group_size = n, k, codes.group_size
        self._native = _native_gemm(k, codes.group_size)
        self.packed: torch.Tensor
        self.scales_and_zeros: torch.Tensor
        if self._native is not None:
            packed, sz = pack_int4_native(codes)
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.codes.to(torch.int32).contiguous(), 1)
            # The kernel's layout: (K // group_size, N, 2) of (scale, zero).
            sz = torch.stack([codes.scales.t(), codes.zeros.t()], dim=-1).to(KERNEL_DTYPE).contiguous()
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", sz)

    @classmethod
    def from_float(cls, w: torch.Tensor, group_size: int) -> Int4Linear:
        return cls(quantize_int4(w, group_size))

    @property
    def float32_products(self) -> bool:
        """True when ``forward`` multiplies in float32 (the native kernel), False for bfloat16 (torch's)."""
        return self._native is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._native is not None:
            return _run_native(self._native.int4_gemm, self._native.int4_dequant, x, self.out_features, self.packed,
                               self.scales_and_zeros,
                               self.group_size)
        x2 = x.reshape(-1, self.in_features).to(KERNEL_DTYPE)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.group_size, self.scales_and_zeros)
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 group {self.group_size}"


def pack_int4_native(codes: Int4Codes) -> tuple[torch.Tensor, torch.Tensor]:
    """The native kernel's layout of ``codes``: nibbles (N, K / 2) uint8 and float16 ``(d, m)`` (N, K / G, 2).

    Per block of 32 columns, byte j holds column j (low nibble) and column
    j + 16 (high nibble). ``d = scale`` and ``m = zero - 8 * scale`` (computed
    in float32, then rounded to float16), so ``w = q * d + m``.
    """
    n, k = codes.shape
    c = codes.codes.view(n, k // 32, 2, 16)
    packed = (c[:, :, 0, :] | (c[:, :, 1, :] << 4)).reshape(n, k // 2).contiguous()
    d, z = codes.scales.float(), codes.zeros.float()
    dm = torch.stack([d, z - 8.0 * d], dim=-1).to(torch.float16).contiguous()
    return packed, dm


QuantizedLinear = Int8Linear | Int4Linear
