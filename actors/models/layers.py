"""Building blocks of decoder-only transformers, ready for tensor parallelism.

Every parallel layer holds only this rank's shard and exposes
``load_weight(param_name, full_tensor, shard_id)``: it receives the *full*
Hugging Face tensor and keeps its own slice, so a checkpoint is streamed once
per rank without any resharding step. With ``tp_size == 1`` no collective is
ever called, so a single process needs no ``torch.distributed`` setup.
"""

from __future__ import annotations

from abc import ABCMeta, abstractmethod

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from actors.models import cpu_linear
from actors.models.embedding import ParallelLMHead as ParallelLMHead
from actors.models.embedding import VocabParallelEmbedding as VocabParallelEmbedding
from actors.models.lora import LoRAWeights
from actors.models.quant_linear import (
    INT4_OUT_MULTIPLE,
    Int4Codes,
    Int4Linear,
    Int4Staging,
    Int8Linear,
    QuantizedLinear,
)
from actors.models.rotary import RotaryEmbedding as RotaryEmbedding
from actors.models.rotary import apply_rotary as apply_rotary
from actors.models.rotary import rope_inv_freq as rope_inv_freq
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


def _divide(total: int, tp_size: int, what: str) -> int:
    if total % tp_size:
        raise InvalidParameterError(
            "tensor_parallel_size", f"{what} ({total}) is not divisible by tensor_parallel_size ({tp_size})"
        )
    return total // tp_size


class ParallelLinear(nn.Module, metaclass=ABCMeta):
    """Shared storage of the linear layers: an (out, in) weight and optional bias.

    Subclasses say which rows or columns of a full checkpoint tensor this rank
    keeps (``_copy_shard``) and which parts a fused weight is made of
    (``shard_ids``). The same slicing applies to the codes, scales and zeros of
    an ``Int4Codes`` weight read directly from a quantized file; the layer
    packs it once every part has arrived. Quantized (``quant`` set), the float
    ``weight`` is an empty tensor and its memory is freed.
    """

    shard_ids: tuple[str | int | None, ...] = (None,)

    def __init__(self, in_features: int, out_features: int, bias: bool, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.in_features, self.out_features = in_features, out_features  # this rank's
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.packed: torch.Tensor | None = None  # the oneDNN-packed weight, once pack_for_cpu() ran
        self.quant: QuantizedLinear | None = None
        self._staged: Int4Staging | None = None
        self.lora: LoRAWeights | None = None  # resident adapters (``actors.models.lora``), with enable_lora

    def lora_dims(self, shard_id: str | int | None) -> tuple[int, int]:
        """The full (in, out) features of part ``shard_id``, as a checkpoint (and a LoRA adapter) holds it."""
        return self.in_features, self.out_features * self.tp_size

    def lora_part_sizes(self) -> list[int]:
        """Each fused part's output columns on this rank, in ``shard_ids`` order."""
        return [self.out_features]

    def lora_slice(
        self, shard_id: str | int | None, a: torch.Tensor, b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of part ``shard_id``'s LoRA ``a`` (r, in) and ``b`` (out, r).

        Column-parallel (this default): all of ``a``; ``b``'s rows this rank
        keeps, placed where the part's outputs sit in the fused layer (zeros
        elsewhere), exactly as ``_copy_shard`` places the base weight.
        """
        local_b = b.new_zeros(self.out_features, b.shape[1])
        self._copy_shard(local_b, b, shard_id)
        return a, local_b

    def _param(self, param_name: str) -> nn.Parameter:
        param = getattr(self, param_name)
        assert isinstance(param, nn.Parameter), f"no parameter {param_name!r}"
        return param

    @abstractmethod
    def _copy_shard(self, dst: torch.Tensor, loaded: torch.Tensor, shard_id: str | int | None) -> None:
        """Copy this rank's part of full tensor ``loaded`` (rows, or columns for row-parallel) into ``dst``."""

    def load_weight(
        self, param_name: str, loaded: torch.Tensor | Int4Codes, shard_id: str | int | None = None
    ) -> None:
        """Load full tensor ``loaded`` (part ``shard_id`` of a fused weight); keep this rank's slice."""
        if isinstance(loaded, Int4Codes):
            assert param_name == "weight", param_name
            self._stage_int4(loaded, shard_id)
            return
        self._copy_shard(self._param(param_name).data, loaded, shard_id)

    def _stage_int4(self, loaded: Int4Codes, shard_id: str | int | None) -> None:
        if self._staged is None:
            self.check_int4(loaded.group_size)
            self._staged = Int4Staging.allocate(self.out_features, self.in_features, loaded.group_size)
        staged = self._staged
        assert staged.group_size == loaded.group_size, (staged.group_size, loaded.group_size)
        for dst, src in zip(staged.codes.parts(), loaded.parts(), strict=True):
            self._copy_shard(dst, src, shard_id)
        staged.arrived.add(shard_id)
        if staged.arrived == set(self.shard_ids):
            self._staged = None
            self.set_quant(Int4Linear(staged.codes))

    def check_int4(self, group_size: int) -> None:
        """Raise ``InvalidParameterError`` unless this rank's weight fits the int4 kernel."""
        if self.in_features % group_size:
            split = f" (its input split over tensor_parallel_size={self.tp_size})" if self.tp_size > 1 else ""
            raise InvalidParameterError(
                "quantization_group_size",
                f"int4 groups of {group_size} do not divide a linear layer's {self.in_features} "
                f"input features{split}; choose a group size that does",
            )
        if self.out_features % INT4_OUT_MULTIPLE:
            raise InvalidParameterError(
                "quantization",
                f"int4 needs out_features divisible by {INT4_OUT_MULTIPLE}; a linear layer has {self.out_features}",
            )

    def quantize(self, method: str, group_size: int | None) -> None:
        """Quantize the loaded float weight (``int8`` or ``int4``) unless it was loaded quantized."""
        if self.quant is not None:
            return
        assert self._staged is None, "an int4 weight is still missing parts"
        if method == "int8":
            self.set_quant(Int8Linear.from_float(self.weight.data))
        elif method == "int4":
            assert group_size is not None
            self.check_int4(group_size)
            self.set_quant(Int4Linear.from_float(self.weight.data, group_size))
        else:
            raise AssertionError(f"unknown quantization method {method!r}")

    def set_quant(self, quant: QuantizedLinear) -> None:
        """Compute through ``quant`` from now on and free the float weight."""
        assert (quant.out_features, quant.in_features) == (self.out_features, self.in_features)
        self.quant, self.packed = quant, None
        self.weight = nn.Parameter(self.weight.new_empty(0, self.in_features), requires_grad=False)

    def pack_for_cpu(self) -> bool:
        """Add a oneDNN-packed copy of the loaded weight (``cpu_linear``); False keeps it dense only.

        The dense weight stays too: products of at most ``cpu_linear.DENSE_MAX_ROWS``
        rows (batch-1 decode) stream it faster (``cpu_linear.dense``).
        A quantized layer has no float weight to pack: False.
        """
        if self.quant is not None:
            return False
        bias = self.bias.data if self.bias is not None else None
        packed = cpu_linear.pack(self.weight.data, bias)
        if packed is None:
            return False
        self.packed = packed
        return True

    def _linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.quant is not None:
            y = self.quant(x)
            return y if bias is None else y + bias
        if self.packed is not None and x.shape[0] > cpu_linear.DENSE_MAX_ROWS:
            return cpu_linear.linear(x, self.packed, bias)
        return cpu_linear.dense(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._linear(x, self.bias)
        return y if self.lora is None else self.lora.add_delta(x, y)


class ColumnParallelLinear(ParallelLinear):
    """``y = xW^T + b`` with the output dim split across ranks (no gather)."""

    def __init__(
        self, in_features: int, out_features: int, *, bias: bool = False, tp_rank: int = 0, tp_size: int = 1
    ) -> None:
        out = _divide(out_features, tp_size, "output features")
        super().__init__(in_features, out, bias, tp_rank, tp_size)

    def _copy_shard(self, dst: torch.Tensor, loaded: torch.Tensor, shard_id: str | int | None) -> None:
        """Keep rows ``rank*n .. (rank+1)*n`` of the full tensor."""
        n = dst.shape[0]
        dst.copy_(loaded.narrow(0, self.tp_rank * n, n))


class MergedColumnParallelLinear(ParallelLinear):
    """Several column-parallel projections of one input fused (gate and up).

    Shard ``i`` of the rank's output holds this rank's slice of projection ``i``.
    """

    shard_ids = (0, 1)

    def __init__(
        self, in_features: int, out_features: list[int], *, bias: bool = False, tp_rank: int = 0, tp_size: int = 1
    ) -> None:
        self.shard_sizes = [_divide(o, tp_size, "output features") for o in out_features]
        super().__init__(in_features, sum(self.shard_sizes), bias, tp_rank, tp_size)

    def lora_dims(self, shard_id: str | int | None) -> tuple[int, int]:
        assert isinstance(shard_id, int)
        return self.in_features, self.shard_sizes[shard_id] * self.tp_size

    def lora_part_sizes(self) -> list[int]:
        return list(self.shard_sizes)

    def _copy_shard(self, dst: torch.Tensor, loaded: torch.Tensor, shard_id: str | int | None) -> None:
        """Load full projection number ``shard_id`` into its place in the fused weight."""
        assert isinstance(shard_id, int)
        n = self.shard_sizes[shard_id]
        offset = sum(self.shard_sizes[:shard_id])
        dst.narrow(0, offset, n).copy_(loaded.narrow(0, self.tp_rank * n, n))


class QKVParallelLinear(ParallelLinear):
    """Fused q/k/v projection; heads split across ranks.

    With fewer KV heads than ranks, each KV head is replicated on
    ``tp_size // num_kv_heads`` consecutive ranks (each rank then holds one).
    """

    shard_ids = ("q", "k", "v")

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
        self.total_heads, self.total_kv_heads = num_heads, num_kv_heads
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

    def lora_dims(self, shard_id: str | int | None) -> tuple[int, int]:
        heads = self.total_heads if shard_id == "q" else self.total_kv_heads
        return self.in_features, heads * self.head_dim

    def lora_part_sizes(self) -> list[int]:
        kv = self.num_kv_heads * self.head_dim
        return [self.num_heads * self.head_dim, kv, kv]

    def _copy_shard(self, dst: torch.Tensor, loaded: torch.Tensor, shard_id: str | int | None) -> None:
        """Load the full ``q``, ``k`` or ``v`` tensor (``shard_id``); keep this rank's heads."""
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if shard_id == "q":
            dst, src = dst.narrow(0, 0, q_size), loaded.narrow(0, self.tp_rank * q_size, q_size)
        elif shard_id in ("k", "v"):
            offset = q_size if shard_id == "k" else q_size + kv_size
            dst = dst.narrow(0, offset, kv_size)
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

    def load_weight(
        self, param_name: str, loaded: torch.Tensor | Int4Codes, shard_id: str | int | None = None
    ) -> None:
        """Keep columns ``rank*n .. (rank+1)*n`` of the weight; the bias is whole."""
        if param_name == "bias":
            assert isinstance(loaded, torch.Tensor)
            self._param("bias").data.copy_(loaded)
            return
        super().load_weight(param_name, loaded, shard_id)

    def _copy_shard(self, dst: torch.Tensor, loaded: torch.Tensor, shard_id: str | int | None) -> None:
        # Also the (N, K / group) scales and zeros of int4 codes: check_int4 made
        # the rank's K a whole number of groups, so the same rank offset holds.
        n = dst.shape[1]
        dst.copy_(loaded.narrow(1, self.tp_rank * n, n))

    def lora_dims(self, shard_id: str | int | None) -> tuple[int, int]:
        return self.in_features * self.tp_size, self.out_features

    def lora_slice(
        self, shard_id: str | int | None, a: torch.Tensor, b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The columns of ``a`` this rank's inputs meet, and all of ``b``: its partial delta joins the all-reduce."""
        local_a = a.new_zeros(a.shape[0], self.in_features)
        self._copy_shard(local_a, a, shard_id)
        return local_a, b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            y = self._linear(x, self.bias)
            return y if self.lora is None else self.lora.add_delta(x, y)
        y = self._linear(x, None)
        if self.lora is not None:  # a partial delta, like the partial product: summed by the all-reduce
            y = self.lora.add_delta(x, y)
        dist.all_reduce(y)
        return y if self.bias is None else y + self.bias
