"""Quantized KV pages: the torch reference of how K and V are stored and read back.

A quantized pool (``kv_cache_dtype`` int8 or fp8_e4m3, see ``kv_dtypes``)
holds one byte per element and one bfloat16 scale per token and kv head:
``x ~= q * scale``. ``quantize_kv`` is the write: the scale is the vector's
absolute maximum over the format's largest value (127 for int8, 448 for
e4m3), rounded to bfloat16 *before* it divides, so what is stored is exact
for the stored scale. ``dequantize_kv`` is the read.

Error bounds per element (``scale`` being the stored one), checked by
``tests/kvcache/test_kv_quant.py``:

- int8: ``|x - q*scale| <= scale / 2`` (round to nearest; the bfloat16
  rounding of the scale can push the largest value at most 0.4% past 127,
  and the clamp then costs at most that much more on it alone).
- fp8_e4m3: ``|x - q*scale| <= |x| / 16 + scale / 1024`` (three mantissa
  bits; subnormals below 2**-6 step by 2**-9).

The native CPU kernels (``cpu_kernels``) write and read the same bytes.
"""

from __future__ import annotations

import torch

from kvcache.kv_dtypes import QUANTIZED_KV_DTYPES

SCALE_DTYPE = torch.bfloat16
STORAGE_DTYPES: dict[str, torch.dtype] = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
QMAX: dict[str, float] = {"int8": 127.0, "fp8_e4m3": 448.0}
# A zero vector's scale: positive (no 0/0) and far below any real value's.
MIN_SCALE = 1e-30


def is_quantized(kv_dtype: str) -> bool:
    """Whether ``kv_dtype`` (a canonical name) stores quantized pages."""
    return kv_dtype in QUANTIZED_KV_DTYPES


def quantize_kv(x: torch.Tensor, kv_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (..., head_dim) -> (values in the storage dtype, bfloat16 scales (...,))."""
    qmax = QMAX[kv_dtype]
    xf = x.float()
    scale = (xf.abs().amax(-1) / qmax).clamp_min(MIN_SCALE).to(SCALE_DTYPE)
    y = xf / scale.float().unsqueeze(-1)
    if kv_dtype == "int8":
        return y.round_().clamp_(-qmax, qmax).to(torch.int8), scale
    return y.clamp_(-qmax, qmax).to(torch.float8_e4m3fn), scale


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Stored values and scales back to ``dtype`` (computed in float32, then cast once)."""
    return (q.float() * scale.float().unsqueeze(-1)).to(dtype)
