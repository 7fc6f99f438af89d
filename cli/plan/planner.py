"""Capacity planning arithmetic for ``flotilla plan``: pure functions, no torch, no Ray.

Model: the weights and the KV cache of ``context x batch`` tokens are split
evenly over ``tp`` ranks, each rank may use ``memory_fraction`` of its GPU, and
activations, CUDA graphs and fragmentation are what the remaining fraction is for.
All sizes are integers in bytes; printing in GB (1e9) and GiB (2**30) is the CLI's job.
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
    """Parameters by part; ``total`` is their sum."""

    embedding: int
    attention: int
    mlp: int
    norms: int
    lm_head: int

    @property
    def total(self) -> int:
        return self.embedding + self.attention + self.mlp + self.norms + self.lm_head


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
    gpu_name: str | None  # None: no GPU given, so no fit table (``fits`` empty, ``tp`` None)
    gpu_memory_bytes: int | None
    memory_fraction: float
    fits: tuple[TpFit, ...]
    tp: int | None  # smallest degree in TP_DEGREES that fits; None when even 8 does not
    cost: CostEstimate | None
    notes: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; ``num_params`` is added next to the breakdown."""
        out = dataclasses.asdict(self)
        out["num_params"] = self.params.total
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


def count_params(model: ModelArch) -> ParamCount:
    """Parameters of a Llama-family decoder: embeddings, GQA attention, SwiGLU MLP, RMSNorms, lm head."""
    h, q_dim, kv_dim = model.hidden_size, model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    attention = h * q_dim + 2 * h * kv_dim + q_dim * h  # q, k, v, o projections
    if model.attention_bias:
        attention += q_dim + 2 * kv_dim
    mlp = 3 * h * model.intermediate_size  # gate, up, down
    n = model.num_layers
    return ParamCount(
        embedding=model.vocab_size * h,
        attention=n * attention,
        mlp=n * mlp,
        norms=(2 * n + 1) * h,  # two per layer and the final one
        lm_head=0 if model.tie_word_embeddings else model.vocab_size * h,
    )


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
    heads = 2 * model.num_layers * model.num_kv_heads
    if kv_dtype in _ENGINE_KV_DTYPES:
        return heads * kv_bytes_per_token_head(model.head_dim, _ENGINE_KV_DTYPES[kv_dtype], 0)
    return bytes_for(heads * model.head_dim, kv_dtype)


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
        kv_bytes=per_token * context * batch, gpu_name=gpu_name, gpu_memory_bytes=gpu_memory_bytes,
        memory_fraction=memory_fraction, fits=fits, tp=smallest, cost=cost, notes=tuple(notes),
    )
