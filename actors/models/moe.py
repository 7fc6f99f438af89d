"""Mixture-of-experts feed-forward (Qwen3-MoE, Qwen2-MoE, Mixtral), tensor- or expert-parallel.

A router picks ``top_k`` of ``num_experts`` SiLU-gated MLPs per token; their
outputs, scaled by the routing weights, are summed (Qwen2-MoE adds a
sigmoid-gated shared expert that every token passes through). The arithmetic
follows the Hugging Face blocks (``Qwen3MoeSparseMoeBlock``,
``MixtralSparseMoeBlock``, ``Qwen2MoeSparseMoeBlock``): router logits in the
hidden dtype, softmax and renormalisation in float32, each expert's weighted
output rounded to the hidden dtype before the sum.

Sharding over ``tp_size`` ranks, either way with one ``all_reduce`` per
forward (the experts' and the shared expert's partial sums are added first):

* tensor parallel (default): every rank holds every expert, with its slice
  of the intermediate dimension (gate/up rows, down columns), as a dense MLP;
* expert parallel: rank ``r`` holds experts ``[r*E/tp, (r+1)*E/tp)`` whole;
  the (token, expert) pairs routed to other ranks' experts contribute zero
  here and their owner's output arrives through the reduction.

The router weight is replicated; the shared expert is always split like a
dense MLP. Checkpoints name each expert separately
(``experts.{e}.gate_proj.weight`` ...); ``load_checkpoint`` takes such a full
tensor and keeps this rank's part, like ``ParallelLinear.load_weight``.
Weights are never quantized (the model refuses quantization of MoE models).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from scheduling.errors import InvalidParameterError

# Per-expert checkpoint names -> (our tensor, part). Mixtral calls them w1 (gate), w3 (up), w2 (down).
_EXPERT_PARTS: dict[str, tuple[str, int]] = {
    "gate_proj": ("w13", 0),
    "up_proj": ("w13", 1),
    "down_proj": ("w2", 0),
    "w1": ("w13", 0),
    "w3": ("w13", 1),
    "w2": ("w2", 0),
}
_QWEN_NAMES = ("gate_proj", "up_proj", "down_proj")
_MIXTRAL_NAMES = ("w1", "w3", "w2")
_EXPERT_NAME = re.compile(r"experts\.(\d+)\.(\w+)\.weight")
_SHARED_NAME = re.compile(r"shared_expert\.(gate_proj|up_proj|down_proj)\.weight")


@dataclass(frozen=True)
class MoEArgs:
    """Geometry and routing rule of one mixture-of-experts feed-forward.

    ``renormalize``: rescale the top-k probabilities to sum to one (Mixtral
    always; Qwen MoE configs: ``norm_topk_prob``). ``shared_intermediate_size``:
    Qwen2-MoE's sigmoid-gated shared expert (None: no shared expert).
    ``expert_parallel``: spread whole experts over the ranks instead of
    splitting each one. ``float32_routing_weights``: scale the expert outputs
    by the float32 routing weights, as HF Mixtral does; the Qwen MoE routers
    (the default, False) first round the weights to the hidden dtype. The two
    agree exactly in float32 and differ by one bf16 rounding in bf16.
    """

    num_experts: int
    top_k: int
    intermediate_size: int  # per expert
    renormalize: bool
    shared_intermediate_size: int | None = None
    expert_parallel: bool = False
    float32_routing_weights: bool = False


def _split(total: int, tp_size: int, what: str) -> int:
    if total % tp_size:
        raise InvalidParameterError(
            "tensor_parallel_size", f"{what} ({total}) is not divisible by tensor_parallel_size ({tp_size})"
        )
    return total // tp_size


GROUPED_MM_ALIGN = 16  # bytes: torch._grouped_mm's alignment of data pointers and row strides


def _grouped_mm_fits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes ``a`` (N, K) and ``b`` (G, K, M) (it checks on every device).

    It wants 16-byte aligned data pointers and row strides: K and M a multiple
    of 16 bytes (8 bf16 values). Every real MoE checkpoint qualifies, even
    split 8 ways; only odd toy sizes take the loop.
    """
    size = a.element_size()
    return (
        a.shape[1] * size % GROUPED_MM_ALIGN == 0
        and b.shape[2] * size % GROUPED_MM_ALIGN == 0
        and a.data_ptr() % GROUPED_MM_ALIGN == 0
        and b.data_ptr() % GROUPED_MM_ALIGN == 0
        and a.dtype in (torch.float32, torch.bfloat16, torch.float16)
    )


# Compute capability majors on which torch._grouped_mm has a device kernel (CUTLASS, bf16 only): sm90, sm100.
GROUPED_MM_DEVICE_MAJORS = (9, 10)


def grouped_mm_on_device(dtype: torch.dtype, capability: tuple[int, int] | None) -> bool:
    """Whether ``torch._grouped_mm`` runs its device kernel for weights of ``dtype`` on a GPU of ``capability``.

    That kernel reads the group offsets on the device, so a CUDA graph can
    capture it. Anywhere else (``capability`` None: not CUDA; other dtypes
    or GPUs) it is a loop of one ``mm`` per group that first copies the
    offsets to the host: a sync that a graph cannot hold (capture fails, or
    a replay would reuse the captured step's group sizes).
    """
    return capability is not None and dtype == torch.bfloat16 and capability[0] in GROUPED_MM_DEVICE_MAJORS


def grouped_linear(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows ``offs[g-1]:offs[g]`` of ``a`` (N, K) times ``b[g]`` (K, M): an (N, M) result.

    ``offs`` holds int32 cumulative row ends; rows past ``offs[-1]`` are left
    unspecified (``_grouped_mm`` does not write them), so a caller masks them.

    ``torch._grouped_mm`` is one call for all groups: on CUDA bf16 (sm90/sm100)
    a CUTLASS kernel that reads ``offs`` on the device (no host sync, graph
    capturable); elsewhere (CPU, other dtypes and GPUs) torch's C++ loop of
    one ``mm`` per group, which copies ``offs`` to the host. On the CPU a
    Python loop over experts times the same within noise (docs/design_costs.md,
    entry ``moe_grouped``), so one code path serves every device. ``b``
    is the checkpoint's (out, in) layout transposed as a view, the "NT"
    product ``F.linear`` runs and the column-major layout the CUDA kernel
    takes; storing the weights transposed is no faster on the CPU (same
    entry), so they stay as loaded, with no per-step copy. Shapes
    ``_grouped_mm`` refuses (unaligned toy sizes) take that Python loop here.
    """
    if _grouped_mm_fits(a, b):
        return torch._grouped_mm(a, b, offs=offs)
    out = a.new_zeros(a.shape[0], b.shape[2])
    start = 0
    for g, end in enumerate(offs.tolist()):  # one host sync; only for sizes _grouped_mm refuses
        if end > start:
            torch.mm(a[start:end], b[g], out=out[start:end])
        start = end
    return out


class SparseMoE(nn.Module):
    """Router, experts and optional shared expert of one layer; ``forward`` (T, H) -> (T, H), reduced.

    Parameters (this rank's): ``gate`` (E, H) router, replicated; ``w13``
    (E_local, 2*I_local, H), each expert's gate rows then up rows; ``w2``
    (E_local, H, I_local); with a shared expert ``shared_w13`` (2*Is_local, H),
    ``shared_w2`` (H, Is_local) and ``shared_gate`` (1, H), replicated.
    ``expert_tokens`` (E,) int64 counts every (token, expert) routing choice
    since construction, accumulated on the device without a host sync (every
    rank routes every token, so each rank's count is the global one).
    ``count_rows``, while set (``DecodeGraphs`` sets it around its forwards),
    weighs each row's choices by its value (1 for a token, 0 for padding), so
    a padded static-shape step counts only its real tokens.
    """

    expert_tokens: torch.Tensor
    count_rows: torch.Tensor | None

    def __init__(self, hidden_size: int, args: MoEArgs, *, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.hidden_size, self.args = hidden_size, args
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.num_experts, self.top_k = args.num_experts, args.top_k
        if args.expert_parallel:
            self.num_local_experts = _split(args.num_experts, tp_size, "num_experts (expert parallel)")
            self.local_intermediate = args.intermediate_size
        else:
            self.num_local_experts = args.num_experts
            self.local_intermediate = _split(args.intermediate_size, tp_size, "moe_intermediate_size")
        self.first_expert = tp_rank * self.num_local_experts if args.expert_parallel else 0
        e, i = self.num_local_experts, self.local_intermediate
        self.gate = nn.Parameter(torch.empty(args.num_experts, hidden_size), requires_grad=False)
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, hidden_size, i), requires_grad=False)
        self.shared_w13: nn.Parameter | None = None
        self.shared_w2: nn.Parameter | None = None
        self.shared_gate: nn.Parameter | None = None
        if args.shared_intermediate_size is not None:
            # Split like a dense MLP in both modes: its partial sum joins the experts' in the one reduction.
            s = _split(args.shared_intermediate_size, tp_size, "shared_expert_intermediate_size")
            self.shared_w13 = nn.Parameter(torch.empty(2 * s, hidden_size), requires_grad=False)
            self.shared_w2 = nn.Parameter(torch.empty(hidden_size, s), requires_grad=False)
            self.shared_gate = nn.Parameter(torch.empty(1, hidden_size), requires_grad=False)
        # Not persistent: a counter, not a weight (state_dict and checkpoints leave it out).
        self.register_buffer("expert_tokens", torch.zeros(args.num_experts, dtype=torch.int64), persistent=False)
        self.count_rows = None  # every row counts; a static-shape step's int64 row weights while it runs
        self._names = _QWEN_NAMES  # switched to Mixtral's once such a name is loaded (checkpoint_names)

    def graph_refusal(self, capability: tuple[int, int] | None) -> str | None:
        """Why this layer's forward cannot be captured in a CUDA graph on ``capability``; None: it can.

        Both grouped products must take ``torch._grouped_mm``'s device kernel
        (``grouped_mm_on_device``) at shapes it accepts (``_grouped_mm_fits``:
        16-byte rows); otherwise ``grouped_linear`` syncs with the host.
        """
        dtype = self.w13.dtype
        if not grouped_mm_on_device(dtype, capability):
            where = "a CPU" if capability is None else f"sm{capability[0]}{capability[1]}"
            return (f"this MoE model's grouped expert products run torch._grouped_mm's host-copying loop for "
                    f"{str(dtype).removeprefix('torch.')} on {where} (its device kernel needs bfloat16 on sm90 or "
                    f"sm100), which a CUDA graph cannot capture")
        row_bytes = torch.empty((), dtype=dtype).element_size()
        unaligned = [n for n in (self.hidden_size, self.local_intermediate) if n * row_bytes % GROUPED_MM_ALIGN]
        if unaligned:
            return (f"this MoE model's expert sizes {unaligned} (per shard) are not multiples of 16 bytes, so its "
                    f"grouped expert products take a host-syncing loop, which a CUDA graph cannot capture")
        return None

    # ---- loading -----------------------------------------------------------------------------

    def checkpoint_names(self) -> set[str]:
        """Every block-relative checkpoint name this rank needs (EP: its own experts only).

        Expert names follow the checkpoint's family: Qwen's ``gate_proj``/
        ``up_proj``/``down_proj``, or Mixtral's ``w1``/``w3``/``w2`` once a
        Mixtral-named tensor was loaded, so that they compare with the names
        the loader passed to ``load_checkpoint``.
        """
        names = {"gate.weight"}
        for e in range(self.first_expert, self.first_expert + self.num_local_experts):
            names |= {f"experts.{e}.{part}.weight" for part in self._names}
        if self.shared_gate is not None:
            names |= {f"shared_expert.{part}.weight" for part in _QWEN_NAMES} | {"shared_expert_gate.weight"}
        return names

    def load_checkpoint(self, name: str, tensor: torch.Tensor) -> None:
        """Copy this rank's part of full checkpoint tensor ``name`` (relative to the block).

        An expert another rank holds (expert parallel) is accepted and
        ignored. Raises ``ValueError`` for a name with no place here or a
        tensor of the wrong full shape.
        """
        h = self.hidden_size
        if name == "gate.weight":
            self._copy(name, self.gate, tensor, (self.num_experts, h))
            return
        expert = _EXPERT_NAME.fullmatch(name)
        if expert is not None and expert.group(2) in _EXPERT_PARTS:
            e, part = int(expert.group(1)), expert.group(2)
            if not 0 <= e < self.num_experts:
                raise ValueError(f"MoE checkpoint tensor {name!r}: expert {e} of {self.num_experts}")
            if part in _MIXTRAL_NAMES:
                self._names = _MIXTRAL_NAMES
            local = e - self.first_expert
            if not 0 <= local < self.num_local_experts:
                return  # another rank's expert
            target, index = _EXPERT_PARTS[part]
            full_i, sliced = self.args.intermediate_size, not self.args.expert_parallel  # EP: experts whole
            if target == "w13":
                self._copy(name, None, tensor, (full_i, h))
                self._copy_rows(self.w13.data[local], index, tensor, sliced)
            else:
                self._copy(name, None, tensor, (h, full_i))
                self._copy_cols(self.w2.data[local], tensor, sliced)
            return
        shared = _SHARED_NAME.fullmatch(name)
        if self.shared_w13 is not None and self.shared_w2 is not None and self.shared_gate is not None:
            full_s = self.shared_w2.shape[1] * self.tp_size  # split in both modes, like a dense MLP
            if name == "shared_expert_gate.weight":
                self._copy(name, self.shared_gate, tensor, (1, h))
                return
            if shared is not None and shared.group(1) == "down_proj":
                self._copy(name, None, tensor, (h, full_s))
                self._copy_cols(self.shared_w2.data, tensor, True)
                return
            if shared is not None:
                self._copy(name, None, tensor, (full_s, h))
                self._copy_rows(self.shared_w13.data, 0 if shared.group(1) == "gate_proj" else 1, tensor, True)
                return
        raise ValueError(f"MoE checkpoint tensor {name!r} has no place in {type(self).__name__}")

    @staticmethod
    def _copy(name: str, dst: nn.Parameter | None, tensor: torch.Tensor, full_shape: tuple[int, ...]) -> None:
        """Check ``tensor``'s full shape (copy_ would broadcast a wrong one silently); copy it whole into ``dst``."""
        if tuple(tensor.shape) != full_shape:
            raise ValueError(f"MoE checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {full_shape}")
        if dst is not None:
            dst.data.copy_(tensor)

    def _copy_rows(self, dst: torch.Tensor, part: int, full: torch.Tensor, sliced: bool) -> None:
        """A full gate (part 0) or up (part 1) weight into that half of fused ``dst``: rows ``rank*n ..`` if ``sliced``."""
        n = dst.shape[0] // 2
        dst.narrow(0, part * n, n).copy_(full.narrow(0, self.tp_rank * n if sliced else 0, n))

    def _copy_cols(self, dst: torch.Tensor, full: torch.Tensor, sliced: bool) -> None:
        """A full down weight into ``dst``: columns ``rank*n ..`` if ``sliced``."""
        n = dst.shape[1]
        dst.copy_(full.narrow(1, self.tp_rank * n if sliced else 0, n))

    # ---- forward -----------------------------------------------------------------------------

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing weights and chosen experts, both (T, top_k), as the HF routers compute them.

        Logits in the hidden dtype; softmax, top-k and renormalisation in
        float32; the weights then rounded to the hidden dtype unless
        ``float32_routing_weights`` (Mixtral).
        """
        logits = F.linear(x, self.gate)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.args.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.args.float32_routing_weights:
            weights = weights.to(x.dtype)
        return weights, experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        num_tokens, k = x.shape[0], self.top_k
        weights, experts = self.route(x)
        flat = experts.reshape(-1)  # pair p = token p // k, slot p % k
        if self.count_rows is None:
            counted = torch.ones_like(flat)
        else:  # padding rows of a static-shape step weigh 0 (a device tensor: no host sync, graph capturable)
            counted = self.count_rows[:num_tokens].unsqueeze(1).expand(num_tokens, k).reshape(-1)
        self.expert_tokens.scatter_add_(0, flat, counted)
        # Sort the pairs by local expert; other ranks' experts (EP) get key E_local and sort last,
        # past the final group end, where the grouped products do not reach.
        local = flat - self.first_expert if self.first_expert else flat
        if self.args.expert_parallel:
            outside = (local < 0) | (local >= self.num_local_experts)
            local = local.masked_fill(outside, self.num_local_experts)
        keys, order = torch.sort(local)
        bounds = torch.arange(self.num_local_experts, device=x.device, dtype=keys.dtype)
        offs = torch.searchsorted(keys, bounds, right=True, out_int32=True)  # cumulative row ends, no host sync
        rows = x.index_select(0, order // k)
        gate_up = grouped_linear(rows, self.w13.transpose(1, 2), offs)
        gate, up = gate_up.chunk(2, dim=-1)
        y = grouped_linear(F.silu(gate) * up, self.w2.transpose(1, 2), offs)
        # Each weighted output rounded to the hidden dtype, as HF adds them into a hidden-dtype buffer.
        y = (y * weights.reshape(-1).index_select(0, order).unsqueeze(-1)).to(x.dtype)
        if self.args.expert_parallel:
            # where, not a zero weight: rows past the last group are uninitialised (NaN * 0 is NaN).
            y = torch.where((keys < self.num_local_experts).unsqueeze(-1), y, y.new_zeros(()))
        # Back to (token, slot) order through the inverse permutation: a deterministic sum over the
        # k slots (an index_add would sum in a device-dependent order for k > 2).
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=x.device))
        out = y.index_select(0, inverse).view(num_tokens, k, self.hidden_size).sum(dim=1, dtype=torch.float32).to(x.dtype)
        if self.shared_w13 is not None and self.shared_w2 is not None and self.shared_gate is not None:
            s_gate, s_up = F.linear(x, self.shared_w13).chunk(2, dim=-1)
            shared = F.linear(F.silu(s_gate) * s_up, self.shared_w2)
            out = out + torch.sigmoid(F.linear(x, self.shared_gate)) * shared
        if self.tp_size > 1:
            dist.all_reduce(out)
        return out
