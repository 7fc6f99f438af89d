"""What each ``kv_cache_dtype`` stores, in plain numbers (no torch: the planner reads it too).

``auto`` keeps K and V in the model dtype. ``int8`` and ``fp8_e4m3`` (``fp8``
is its alias, vLLM's names) store one byte per element plus one bfloat16
scale per token and kv head, for K and for V alike, beside the pages.

Why per token and head, not per page: a page fills one token at a time
during decode, so a page-wide scale would have to be widened (and the page's
earlier tokens requantized, each time adding error) whenever a new token is
larger than everything before it. A token's scale is fixed when it is
written, its quantized values never change, and two sequences that share a
prefix page read exactly the same bytes. The cost is 2 bytes per 128 (or 64)
elements: at head_dim 64 an int8 token takes 66 bytes per head against 128
in bfloat16 (1.94x the pages) or 256 in float32 (3.88x). bfloat16 holds any
float32 range, and quantizing with the rounded scale means its coarser
mantissa costs nothing but a sliver of the int8 range.
"""

from __future__ import annotations

from kvcache.errors import CacheConfigError

# The names ``kv_cache_dtype`` accepts; aliases map to their canonical name.
KV_CACHE_DTYPES: dict[str, str] = {"auto": "auto", "int8": "int8", "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3"}
QUANTIZED_KV_DTYPES = ("int8", "fp8_e4m3")
KV_ELEMENT_BYTES = 1  # int8 and fp8_e4m3
KV_SCALE_BYTES = 2  # one bfloat16 scale per (token, kv head), for K and for V


def canonical_kv_dtype(name: str) -> str:
    """``auto``, ``int8`` or ``fp8_e4m3``; an unknown name is a ``CacheConfigError`` naming ``kv_cache_dtype``."""
    if name not in KV_CACHE_DTYPES:
        raise CacheConfigError(
            "kv_cache_dtype", f"must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}"
        )
    return KV_CACHE_DTYPES[name]


def kv_bytes_per_token_head(head_dim: int, kv_dtype: str, model_element_bytes: int) -> int:
    """Bytes one token's K (or V) of one kv head takes, scale included.

    ``kv_dtype`` is a canonical name; ``model_element_bytes`` is the model
    dtype's element size, used for ``auto``.
    """
    if kv_dtype == "auto":
        return head_dim * model_element_bytes
    assert kv_dtype in QUANTIZED_KV_DTYPES, kv_dtype
    return head_dim * KV_ELEMENT_BYTES + KV_SCALE_BYTES
