"""Capacity planning arithmetic for ``flotilla plan``: pure functions, no torch, no Ray.

Model: the weights and the KV cache of ``context x batch`` tokens are split
evenly over ``tp`` ranks, each rank may use ``memory_fraction`` of its GPU, and
activations, CUDA graphs and fragmentation are what the remaining fraction is for.
All sizes are integers in bytes; printing in GB (1e9) and GiB (2**30) is the CLI's job.

KV cache and sliding windows: flotilla keeps every page of a sequence for
every layer, windowed or not (one page table serves all layers, and prefix
caching needs the pages), so ``kv_bytes_per_token`` counts all layers x the
whole context and is what flotilla allocates. ``kv_bytes_per_token_window_aware``
is what an allocator that dropped out-of-window KV per layer would need at the
planned context (a windowed layer holds ``min(context, window)`` tokens); the
two differ only for models with sliding-window layers (Gemma 2/3, Phi-3, Mistral v0.1).

Parameters: ``total_params`` is everything stored; ``active_params`` what one
token runs through: all of it except the routed experts, of which only the
``top_k`` per MoE layer count (router, shared expert, dense layers, embedding
and lm head count whole, as in the total). Equal for dense models.

Decode traffic (:func:`decode_bytes_per_step`): the bytes one decode step at
batch ``b`` reads from memory, summed over ranks, is

    non-expert weights (once)
    + MoE layers x E x (1 - (1 - k/E)^b) x bytes of one routed expert
    + b x context x kv_bytes_per_token

The middle term is the expected number of distinct experts ``b`` tokens touch
per MoE layer when each picks ``k`` of ``E`` experts uniformly and
independently (``k`` at batch 1, tending to ``E``); real routers are skewed, so
they touch fewer. The KV term is every sequence at its full ``context`` reading
every layer's KV, the pages flotilla keeps; a kernel that skipped out-of-window
pages would read the window-aware amount instead. The embedding table is
counted whole (a decode step gathers only ``b`` rows of it; tied, it is read
whole as the lm head anyway); activations and quantization scales are ignored.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from cli.plan.hardware import DTYPE_BITS, QUANTIZED_DTYPES, ModelArch
from kvcache.kv_dtypes import kv_bytes_per_token_head
from scheduling.errors import InvalidParameterError

# --kv-dtype names -> the engine's kv_cache_dtype when it stores one byte plus scales.
_ENGINE_KV_DTYPES = {"int8": "int8", "fp8": "fp8_e4m3"}
KV_DTYPES: tuple[str, ...] = ("fp32", "fp16", "bf16", "fp8", "int8")

TP_DEGREES: tuple[int, ...] = (1, 2, 4, 8)


@dataclass(frozen=True)
class ParamCount:
    """Parameters by part; ``total`` is their sum and ``active`` what one token runs through.

    ``mlp``: the dense MLPs (every layer of a dense model, the non-MoE layers of
    a MoE). ``norms``: the hidden-size norms; ``qk_norms`` the per-head q/k
    norms. ``router``, ``shared_experts`` (with their gates) and ``experts``
    (every routed expert): the MoE layers. ``active_experts`` is not a part:
    the routed experts one token runs (``top_k`` per MoE layer).
    """

    embedding: int
    attention: int
    mlp: int
    norms: int
    lm_head: int
    qk_norms: int = 0
    router: int = 0
    shared_experts: int = 0
    experts: int = 0
    active_experts: int = 0

    @property
    def total(self) -> int:
        return (self.embedding + self.attention + self.mlp + self.norms + self.lm_head
                + self.qk_norms + self.router + self.shared_experts + self.experts)

    @property
    def active(self) -> int:
        return self.total - self.experts + self.active_experts


@dataclass(frozen=True)
class TpFit:
    """How the model fits on ``tp`` GPUs. Per-rank sizes assume an even split."""

    tp: int
    usable_bytes: int  # tp x memory x fraction
    weight_bytes_per_rank: int
    kv_bytes_per_rank: int  # the KV of context x batch
    fits: bool  # weights + KV(context x batch) <= usable_bytes
    max_num_seqs: int  # sequences of `context` tokens that fit beside the weights


@dataclass(frozen=True)
class CostEstimate:
    """Price of output tokens at a measured throughput on ``num_gpus`` GPUs."""

    price_per_hour: float  # per GPU
    num_gpus: int
    throughput_tok_per_s: float
    cost_per_million_tokens: float


@dataclass(frozen=True)
class PlanReport:
    """Everything ``flotilla plan`` prints; ``to_dict`` is its ``--json`` form."""

    model: ModelArch
    params: ParamCount
    weight_dtype: str
    weight_bytes: int
    weight_bytes_by_dtype: dict[str, int]
    kv_dtype: str
    kv_bytes_per_token: int
    context: int
    batch: int
    kv_bytes: int  # context x batch
    kv_bytes_per_token_window_aware: int  # at `context`, if out-of-window KV were dropped; flotilla keeps it
    kv_bytes_window_aware: int  # context x batch, likewise
    expected_experts_per_layer: float  # distinct routed experts per MoE layer at `batch`; 0: dense
    expected_experts_per_layer_batch1: float
    decode_bytes_per_step: int  # bytes read by one decode step at `batch`
    decode_bytes_per_step_batch1: int
    gpu_name: str | None  # None: no GPU given, so no fit table (``fits`` empty, ``tp`` None)
    gpu_memory_bytes: int | None
    memory_fraction: float
    fits: tuple[TpFit, ...]
    tp: int | None  # smallest degree in TP_DEGREES that fits; None when even 8 does not
    cost: CostEstimate | None
    notes: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; ``num_params`` (= ``total_params``) and ``active_params`` are added
        next to the breakdown."""
        out = dataclasses.asdict(self)
        out["num_params"] = out["total_params"] = self.params.total
        out["active_params"] = self.params.active
        return out


def _check_positive(value: float, param: str, *, integer: bool = False) -> None:
    if integer and (not isinstance(value, int) or isinstance(value, bool)):
        raise InvalidParameterError(param, f"must be an integer, got {value!r}")
    if not (value > 0 and math.isfinite(value)):  # `not >` also rejects NaN
        kind = "integer" if integer else "number"
        raise InvalidParameterError(param, f"must be a positive {kind}, got {value!r}")


def _check_price(price_per_hour: float) -> None:
    if not (price_per_hour >= 0 and math.isfinite(price_per_hour)):
        raise InvalidParameterError("price_per_hour", f"must not be negative, got {price_per_hour!r}")


def _check_dtype(dtype: str, param: str) -> None:
    if dtype not in DTYPE_BITS:
        raise InvalidParameterError(param, f"unknown dtype {dtype!r}; choose from {', '.join(DTYPE_BITS)}")


def expert_params(model: ModelArch) -> int:
    """Parameters of one routed expert: a gated MLP (gate, up, down) of ``moe_intermediate_size``."""
    return 3 * model.hidden_size * model.moe_intermediate_size


def count_params(model: ModelArch) -> ParamCount:
    """Parameters of a decoder: embeddings, GQA attention, gated MLPs or experts, RMSNorms, lm head."""
    h, q_dim, kv_dim = model.hidden_size, model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    attention = h * q_dim + 2 * h * kv_dim + q_dim * h  # q, k, v, o projections
    if model.attention_bias:
        attention += q_dim + 2 * kv_dim
    n = model.num_layers
    moe = len(model.moe_layers)
    shared = model.shared_expert_intermediate_size
    return ParamCount(
        embedding=model.vocab_size * h,
        attention=n * attention,
        mlp=(n - moe) * 3 * h * model.intermediate_size,  # gate, up, down
        norms=(model.norms_per_layer * n + 1) * h,  # per layer and the final one
        lm_head=0 if model.tie_word_embeddings else model.vocab_size * h,
        qk_norms=n * 2 * model.head_dim if model.qk_norm else 0,
        router=moe * h * model.num_experts,
        shared_experts=moe * (3 * h * shared + h) if shared else 0,  # the MLP and its 1-output gate
        experts=moe * model.num_experts * expert_params(model),
        active_experts=moe * model.num_experts_per_tok * expert_params(model),
    )


def expected_experts_touched(num_experts: int, top_k: int, batch: int) -> float:
    """Expected distinct experts that ``batch`` tokens route to in one MoE layer,
    ``E x (1 - (1 - k/E)^b)``, each token picking ``k`` of ``E`` uniformly and
    independently: ``k`` at batch 1, tending to ``E``. 0 for a dense model."""
    _check_positive(batch, "batch", integer=True)
    if num_experts == 0:
        return 0.0
    if not 0 < top_k <= num_experts:
        raise InvalidParameterError("config", f"top_k must be in 1..{num_experts}, got {top_k!r}")
    return float(num_experts * (1 - (1 - top_k / num_experts) ** batch))


def bytes_for(num_elements: int, dtype: str) -> int:
    """Bytes that ``num_elements`` take in ``dtype``, rounded up to a whole byte."""
    _check_dtype(dtype, "dtype")
    return (num_elements * DTYPE_BITS[dtype] + 7) // 8


def default_kv_dtype(weight_dtype: str) -> str:
    """The KV dtype implied by the weights: the same, except quantized weights keep fp16."""
    return "fp16" if weight_dtype in QUANTIZED_DTYPES else weight_dtype


def kv_bytes_per_token(model: ModelArch, kv_dtype: str) -> int:
    """2 (K and V) x layers x KV heads x bytes per head: head_dim elements, plus for
    int8 / fp8 the engine's scale per token and head (``kvcache.kv_dtypes``), so
    the figure is what ``kv_cache_dtype`` makes the engine allocate."""
    if kv_dtype not in KV_DTYPES:
        raise InvalidParameterError(
            "kv_dtype", f"the engine stores KV as {', '.join(KV_DTYPES)}; {kv_dtype!r} is not one of them"
        )
    return model.num_layers * _kv_bytes_per_layer_token(model, kv_dtype)


def _kv_bytes_per_layer_token(model: ModelArch, kv_dtype: str) -> int:
    """One layer's K and V of one token (every KV dtype is a whole number of bytes per head)."""
    heads = 2 * model.num_kv_heads
    if kv_dtype in _ENGINE_KV_DTYPES:
        return heads * kv_bytes_per_token_head(model.head_dim, _ENGINE_KV_DTYPES[kv_dtype], 0)
    return bytes_for(heads * model.head_dim, kv_dtype)


def kv_bytes_per_sequence_window_aware(model: ModelArch, kv_dtype: str, context: int) -> int:
    """KV bytes of one ``context``-token sequence if each windowed layer kept only its last
    ``sliding_window`` tokens. Flotilla does not do this: it keeps ``context x kv_bytes_per_token``."""
    _check_positive(context, "context", integer=True)
    kv_bytes_per_token(model, kv_dtype)  # validates kv_dtype
    windowed = model.num_sliding_layers
    window = min(context, model.sliding_window or context)
    tokens = (model.num_layers - windowed) * context + windowed * window  # summed over layers
    return tokens * _kv_bytes_per_layer_token(model, kv_dtype)


def decode_bytes_per_step(model: ModelArch, *, dtype: str, kv_dtype: str, context: int, batch: int) -> int:
    """Bytes one decode step of ``batch`` sequences at ``context`` tokens reads, summed over ranks:
    non-expert weights once, the expected distinct routed experts of each MoE layer
    (:func:`expected_experts_touched`), and every sequence's KV. See the module docstring."""
    _check_dtype(dtype, "dtype")
    _check_positive(context, "context", integer=True)
    params = count_params(model)
    touched = expected_experts_touched(model.num_experts, model.num_experts_per_tok, batch)
    expert_bytes = len(model.moe_layers) * touched * bytes_for(expert_params(model), dtype)
    kv = batch * context * kv_bytes_per_token(model, kv_dtype)
    return bytes_for(params.total - params.experts, dtype) + math.ceil(expert_bytes) + kv


def fit_on(tp: int, *, weight_bytes: int, kv_per_token: int, context: int, batch: int,
           gpu_memory_bytes: int, memory_fraction: float) -> TpFit:
    """How weights and the KV of ``context x batch`` tokens fit on ``tp`` GPUs."""
    usable = int(tp * gpu_memory_bytes * memory_fraction)
    kv = kv_per_token * context * batch
    spare = usable - weight_bytes
    return TpFit(
        tp=tp,
        usable_bytes=usable,
        weight_bytes_per_rank=-(-weight_bytes // tp),
        kv_bytes_per_rank=-(-kv // tp),
        fits=weight_bytes + kv <= usable,
        max_num_seqs=max(0, spare // (kv_per_token * context)),
    )


def cost_per_million_tokens(price_per_hour: float, num_gpus: int, throughput_tok_per_s: float) -> float:
    """Price of 1M output tokens: (price per GPU-hour x GPUs) / tokens per hour x 1e6."""
    _check_positive(throughput_tok_per_s, "throughput")
    _check_price(price_per_hour)
    return price_per_hour * num_gpus / (throughput_tok_per_s * 3600) * 1e6


def _tp_notes(model: ModelArch) -> list[str]:
    """Where an even split is optimistic: engines need heads divisible by TP."""
    notes = []
    for tp in TP_DEGREES[1:]:
        if model.num_heads % tp:
            notes.append(f"TP {tp}: {model.num_heads} attention heads do not divide by {tp}; "
                         "engines refuse this degree")
        elif tp > model.num_kv_heads:
            notes.append(f"TP {tp}: only {model.num_kv_heads} KV heads, which engines replicate; "
                         "real KV per rank is larger than shown")
    return notes


def plan(model: ModelArch, *, gpu_name: str | None = None, gpu_memory_bytes: int | None = None,
         dtype: str = "fp16",
         kv_dtype: str | None = None, context: int = 4096, batch: int = 1,
         memory_fraction: float = 0.9, price_per_hour: float | None = None,
         throughput: float | None = None, tp: int | None = None) -> PlanReport:
    """Plan ``model`` on GPUs of ``gpu_memory_bytes`` each.

    Without ``gpu_memory_bytes`` only the weight and KV arithmetic is done:
    no fit table, and a cost only for an explicit ``tp``. ``kv_dtype`` None
    means :func:`default_kv_dtype`. The cost needs both ``price_per_hour``
    (per GPU) and ``throughput`` (output tok/s) and is charged for ``tp``
    GPUs, by default the smallest degree that fits. Raises
    :class:`InvalidParameterError` naming the argument at fault.
    """
    _check_dtype(dtype, "dtype")
    kv_dtype = default_kv_dtype(dtype) if kv_dtype is None else kv_dtype
    _check_dtype(kv_dtype, "kv_dtype")
    _check_positive(context, "context", integer=True)
    _check_positive(batch, "batch", integer=True)
    if gpu_memory_bytes is not None:
        _check_positive(gpu_memory_bytes, "gpu_memory_gb")
    if not 0 < memory_fraction <= 1:
        raise InvalidParameterError("memory_fraction", f"must be in (0, 1], got {memory_fraction!r}")
    if tp is not None and tp not in TP_DEGREES:
        raise InvalidParameterError("tp", f"must be one of {TP_DEGREES}, got {tp!r}")
    if (price_per_hour is None) != (throughput is None):
        missing = "throughput" if throughput is None else "price_per_hour"
        raise InvalidParameterError(missing, "the cost estimate needs both a price and a throughput")
    if price_per_hour is not None and throughput is not None:
        _check_price(price_per_hour)
        _check_positive(throughput, "throughput")
        if gpu_memory_bytes is None and tp is None:
            raise InvalidParameterError(
                "price_per_hour", "the cost needs a GPU count: give --gpu or --gpu-memory-gb, or --tp")

    params = count_params(model)
    weight_bytes = bytes_for(params.total, dtype)
    per_token = kv_bytes_per_token(model, kv_dtype)
    fits = () if gpu_memory_bytes is None else tuple(
        fit_on(degree, weight_bytes=weight_bytes, kv_per_token=per_token, context=context,
               batch=batch, gpu_memory_bytes=gpu_memory_bytes, memory_fraction=memory_fraction)
        for degree in TP_DEGREES)
    smallest = next((f.tp for f in fits if f.fits), None)
    notes = _tp_notes(model)
    window_seq = kv_bytes_per_sequence_window_aware(model, kv_dtype, context)
    if model.num_sliding_layers:
        notes.append(
            f"{model.num_sliding_layers} of {model.num_layers} layers attend within a "
            f"{model.sliding_window:,}-token window; flotilla keeps their KV for the whole context "
            "(one page table for all layers, prefix caching), so KV per token counts every layer: "
            f"{per_token:,} B, against {-(-window_seq // context):,} B if out-of-window KV were dropped")
    if dtype in QUANTIZED_DTYPES:
        notes.append(f"{dtype} weights: quantization scales and any unquantized layers "
                     "(often embeddings and lm head) add a few % not counted here")

    cost = None
    if price_per_hour is not None and throughput is not None:
        num_gpus = tp if tp is not None else smallest
        if num_gpus is None:
            notes.append("no cost: the model does not fit on 8 GPUs (give tp to price it anyway)")
        else:
            cost = CostEstimate(price_per_hour, num_gpus, throughput,
                                cost_per_million_tokens(price_per_hour, num_gpus, throughput))

    return PlanReport(
        model=model, params=params, weight_dtype=dtype, weight_bytes=weight_bytes,
        weight_bytes_by_dtype={d: bytes_for(params.total, d) for d in DTYPE_BITS},
        kv_dtype=kv_dtype, kv_bytes_per_token=per_token, context=context, batch=batch,
        kv_bytes=per_token * context * batch,
        kv_bytes_per_token_window_aware=-(-window_seq // context), kv_bytes_window_aware=window_seq * batch,
        expected_experts_per_layer=expected_experts_touched(
            model.num_experts, model.num_experts_per_tok, batch),
        expected_experts_per_layer_batch1=expected_experts_touched(
            model.num_experts, model.num_experts_per_tok, 1),
        decode_bytes_per_step=decode_bytes_per_step(
            model, dtype=dtype, kv_dtype=kv_dtype, context=context, batch=batch),
        decode_bytes_per_step_batch1=decode_bytes_per_step(
            model, dtype=dtype, kv_dtype=kv_dtype, context=context, batch=1),
        gpu_name=gpu_name, gpu_memory_bytes=gpu_memory_bytes,
        memory_fraction=memory_fraction, fits=fits, tp=smallest, cost=cost, notes=tuple(notes),
    )
