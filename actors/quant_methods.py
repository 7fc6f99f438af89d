"""The weight quantization methods an engine accepts (no torch: the CLI reads them).

int8: weight-only, one scale per output channel. int4: weight-only, groups
of ``INT4_GROUP_SIZES`` along the input (GGUF Q4_0/Q4_1 blocks load
directly, in groups of 32). compressed-tensors: a GPTQ/AWQ checkpoint saved in
that format (``quantization=None`` loads one too, as its config.json says it
is quantized).
"""

from __future__ import annotations

QUANTIZATION_METHODS = ("int8", "int4", "compressed-tensors")
INT4_GROUP_SIZES = (32, 64, 128)
