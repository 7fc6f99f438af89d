"""Linear layers on CPU through oneDNN with prepacked weights.

On CPU, ``F.linear`` calls the BLAS torch was built with (MKL). For the small
row counts of decode steps MKL is slow on some hosts: on this project's AMD
EPYC machine, one thread, a 1024x6144 fp32 product took 2.0 ms at 4 rows
against 0.6 ms through oneDNN with the weight reordered once into its
blocked layout (``torch.ops.mkldnn._reorder_linear_weight``), and 11 ms vs
4.4 ms at 150 rows (``_linear_pointwise``, the op torch's own compiler emits
for CPU linears). vLLM's CPU backend takes the same route.

``pack`` reorders a weight once, after loading, and checks the packed
product against ``F.linear`` on a probe. The dense weight is kept beside
the packed one (the linear weights take twice their memory): for one or
two rows (``DENSE_MAX_ROWS``: batch-1 decode) oneDNN is the slower one,
and MKL's ``F.linear`` streams the dense weight at memory bandwidth. On the
2-core development VM this took SmolLM2-135M's batch-1 decode from 29.05 to
35.24 tok/s (``make bench-batch1``, docs/benchmarks.md); from three rows
up the packed weight is the faster one.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F

logger = logging.getLogger("flotilla.models")

ENV_SWITCH = "FLOTILLA_ONEDNN_LINEAR"
PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
DENSE_MAX_ROWS = 2  # products of this many rows or fewer read the dense weight (F.linear)
_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}  # max error relative to the output's scale
_warned = False


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip() != "0"


def pack(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """``weight`` (out, in) reordered for oneDNN, or None when it cannot or should not be."""
    if not enabled() or weight.device.type != "cpu" or weight.dtype not in PACKABLE_DTYPES:
        return None
    if not torch.backends.mkldnn.is_available() or weight.numel() == 0:
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        probe = torch.randn(3, weight.shape[1], dtype=weight.dtype, generator=torch.Generator().manual_seed(0))
        want = F.linear(probe, weight, bias).float()
        got = linear(probe, packed, bias).float()
        scale = want.abs().max().clamp_min(1e-6)
        if not bool(((got - want).abs().max() / scale) <= _TOLERANCE[weight.dtype]):
            raise RuntimeError("the packed product disagrees with F.linear")
    except Exception as err:  # noqa: BLE001 - any failure keeps the dense path
        _warn_once(err)
        return None
    return packed


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W^T + b`` with a weight from ``pack``."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _warn_once(err: Exception) -> None:
    global _warned
    if not _warned:
        _warned = True
        logger.warning("oneDNN linear unavailable (%s: %s); using F.linear", type(err).__name__, err)
