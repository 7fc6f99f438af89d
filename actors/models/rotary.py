"""Rotary position embedding (RoPE): inverse frequencies, cos/sin tables, the rotation."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from scheduling.errors import InvalidParameterError


def rope_inv_freq(head_dim: int, theta: float, scaling: Mapping[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies (float32, ``head_dim // 2``) for RoPE, with linear or llama3 scaling.

    ``scaling`` is the HF ``rope_scaling`` / ``rope_parameters`` dict or None.
    Only ``default``, ``linear`` and ``llama3`` are implemented; anything else raises, since
    silently ignoring a scaling scheme produces a model that only looks right.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type in (None, "default"):
        return inv_freq
    if rope_type not in ("llama3", "linear"):
        raise InvalidParameterError(
            "model", f"rope type {rope_type!r} is not supported (supported: 'default', 'linear', 'llama3')"
        )
    assert scaling is not None
    if rope_type == "linear":  # positions divided by `factor` (Gemma 3's global layers)
        return inv_freq / float(scaling["factor"])
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the band between
    # interpolated smoothly (Llama 3.1 reference implementation).
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding with cos/sin tables built once up to ``max_positions``.

    Tables stay float32 whatever the model dtype, and are cast per step, which
    rounds exactly as HF does (it computes in float32 and casts to the input dtype).
    """

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq.to(t.device))
        emb = torch.cat((freqs, freqs), dim=-1)  # (max_positions, head_dim), HF layout
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather (T, head_dim) cos and sin for ``positions``; do this once per step."""
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)



def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (T, heads, head_dim) by gathered cos/sin (T, head_dim), HF's half-split layout."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)
