"""The attention backends an engine accepts (no torch: the CLI reads them).

``torch``: the paged-attention reference, on the CPU and CUDA; ``auto``
resolves to it. ``flashinfer``: FlashInfer's kernels, CUDA only
(``kvcache.attention.flashinfer``), refused by name elsewhere rather than
quietly run on torch.
"""

from __future__ import annotations

ATTENTION_BACKENDS = ("auto", "torch", "flashinfer")
