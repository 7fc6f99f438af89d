"""Building blocks of decoder-only transformers, ready for tensor parallelism.

Every parallel layer holds only this rank's shard and exposes
``load_weight(param_name, full_tensor, shard_id)``: it receives the *full*
Hugging Face tensor and keeps its own slice, so a checkpoint is streamed once
per rank without any resharding step. With ``tp_size == 1`` no collective is
ever called, so a single process needs no ``torch.distributed`` setup.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from actors.models import cpu_linear
from scheduling.errors import InvalidParameterError


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, as Hugging Face Llama does."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32:
            # Same arithmetic in one fused op: no casts are needed in fp32.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        # Cast back before the weight multiply: the same rounding as HF in bf16.
        return self.weight * h.to(dtype)


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` over an input whose last dim is ``[gate | up]``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


def rope_inv_freq(head_dim: int, theta: float, scaling: Mapping[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies (float32, ``head_dim // 2``) for RoPE, with llama3 scaling.

    ``scaling`` is the HF ``rope_scaling`` / ``rope_parameters`` dict or None.
    Only ``default`` and ``llama3`` are implemented; anything else raises, since
    silently ignoring a scaling scheme produces a model that only looks right.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type in (None, "default"):
        return inv_freq
    if rope_type != "llama3":
        raise InvalidParameterError(
            "model", f"rope type {rope_type!r} is not supported (supported: 'default', 'llama3')"
        )
    assert scaling is not None
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


def _divide(total: int, tp_size: int, what: str) -> int:
    if total % tp_size:
        raise InvalidParameterError(
            "tensor_parallel_size", f"{what} ({total}) is not divisible by tensor_parallel_size ({tp_size})"
        )
    return total // tp_size


class ParallelLinear(nn.Module):
    """Shared storage of the linear layers: an (out, in) weight and optional bias."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.packed: torch.Tensor | None = None  # the oneDNN-packed weight, once pack_for_cpu() ran

    def _param(self, param_name: str) -> nn.Parameter:
        param = getattr(self, param_name)
        assert isinstance(param, nn.Parameter), f"no parameter {param_name!r}"
        return param

    def pack_for_cpu(self) -> bool:
        """Add a oneDNN-packed copy of the loaded weight (``cpu_linear``); False keeps it dense only.

        The dense weight stays too: products of at most ``cpu_linear.DENSE_MAX_ROWS``
        rows (batch-1 decode) read it through MKL, which streams it faster.
        """
        bias = self.bias.data if self.bias is not None else None
        packed = cpu_linear.pack(self.weight.data, bias)
        if packed is None:
            return False
        self.packed = packed
        return True

    def _linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.packed is not None and x.shape[0] > cpu_linear.DENSE_MAX_ROWS:
            return cpu_linear.linear(x, self.packed, bias)
        return F.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.bias)


class ColumnParallelLinear(ParallelLinear):
    """``y = xW^T + b`` with the output dim split across ranks (no gather)."""

    def __init__(
        self, in_features: int, out_features: int, *, bias: bool = False, tp_rank: int = 0, tp_size: int = 1
    ) -> None:
        out = _divide(out_features, tp_size, "output features")
        super().__init__(in_features, out, bias, tp_rank, tp_size)

    def load_weight(self, param_name: str, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        """Keep rows ``rank*n .. (rank+1)*n`` of the full tensor."""
        param = self._param(param_name)
        n = param.shape[0]
        param.data.copy_(loaded.narrow(0, self.tp_rank * n, n))


class MergedColumnParallelLinear(ParallelLinear):
    """Several column-parallel projections of one input fused (gate and up).

    Shard ``i`` of the rank's output holds this rank's slice of projection ``i``.
    """

    def __init__(
        self, in_features: int, out_features: list[int], *, bias: bool = False, tp_rank: int = 0, tp_size: int = 1
    ) -> None:
        self.shard_sizes = [_divide(o, tp_size, "output features") for o in out_features]
        super().__init__(in_features, sum(self.shard_sizes), bias, tp_rank, tp_size)

    def load_weight(self, param_name: str, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        """Load full projection number ``shard_id`` into its place in the fused weight."""
        assert isinstance(shard_id, int)
        param = self._param(param_name)
        n = self.shard_sizes[shard_id]
        offset = sum(self.shard_sizes[:shard_id])
        param.data.narrow(0, offset, n).copy_(loaded.narrow(0, self.tp_rank * n, n))


class QKVParallelLinear(ParallelLinear):
    """Fused q/k/v projection; heads split across ranks.

    With fewer KV heads than ranks, each KV head is replicated on
    ``tp_size // num_kv_heads`` consecutive ranks (each rank then holds one).
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        *,
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, tp_size, "num_attention_heads")
        if num_kv_heads >= tp_size:
            self.num_kv_heads = _divide(num_kv_heads, tp_size, "num_key_value_heads")
            self.kv_head_start = tp_rank * self.num_kv_heads
        else:
            replicas = _divide(tp_size, num_kv_heads, "tensor_parallel_size over num_key_value_heads")
            self.num_kv_heads = 1
            self.kv_head_start = tp_rank // replicas
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        super().__init__(hidden_size, out, bias, tp_rank, tp_size)

    def load_weight(self, param_name: str, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        """Load the full ``q``, ``k`` or ``v`` tensor (``shard_id``); keep this rank's heads."""
        param = self._param(param_name)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if shard_id == "q":
            dst, src = param.data.narrow(0, 0, q_size), loaded.narrow(0, self.tp_rank * q_size, q_size)
        elif shard_id in ("k", "v"):
            offset = q_size if shard_id == "k" else q_size + kv_size
            dst = param.data.narrow(0, offset, kv_size)
            src = loaded.narrow(0, self.kv_head_start * self.head_dim, kv_size)
        else:
            raise AssertionError(f"bad qkv shard id {shard_id!r}")
        dst.copy_(src)


class RowParallelLinear(ParallelLinear):
    """``y = xW^T + b`` with the input dim split across ranks; partial sums all-reduced.

    The bias is added once, after the reduction.
    """

    def __init__(
        self, in_features: int, out_features: int, *, bias: bool = False, tp_rank: int = 0, tp_size: int = 1
    ) -> None:
        super().__init__(_divide(in_features, tp_size, "input features"), out_features, bias, tp_rank, tp_size)

    def load_weight(self, param_name: str, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        """Keep columns ``rank*n .. (rank+1)*n`` of the weight; the bias is whole."""
        param = self._param(param_name)
        if param_name == "bias":
            param.data.copy_(loaded)
            return
        n = param.shape[1]
        param.data.copy_(loaded.narrow(1, self.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._linear(x, self.bias)
        y = self._linear(x, None)
        dist.all_reduce(y)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding with the vocabulary split in equal contiguous ranges across ranks.

    The vocab is padded up to a multiple of ``tp_size``; padding rows stay zero.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.num_embeddings, self.tp_rank, self.tp_size = num_embeddings, tp_rank, tp_size
        self.num_per_rank = -(-num_embeddings // tp_size)
        self.vocab_start = tp_rank * self.num_per_rank
        self.weight = nn.Parameter(torch.zeros(self.num_per_rank, embedding_dim), requires_grad=False)

    def load_weight(self, param_name: str, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        """Keep this rank's vocab rows of the full (vocab, dim) tensor."""
        n = max(0, min(self.num_per_rank, self.num_embeddings - self.vocab_start))
        self.weight.data.narrow(0, 0, n).copy_(loaded.narrow(0, self.vocab_start, n))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        mask = (local >= 0) & (local < self.num_per_rank)
        y = F.embedding(local.masked_fill(~mask, 0), self.weight) * mask.unsqueeze(-1).to(self.weight.dtype)
        dist.all_reduce(y)
        return y


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection onto the vocab; each rank computes its range, then all-gather."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight)
        if self.tp_size > 1:
            parts = [torch.empty_like(logits) for _ in range(self.tp_size)]
            dist.all_gather(parts, logits)
            logits = torch.cat(parts, dim=-1)
        return logits[..., : self.num_embeddings]
