"""How long a replica's step takes, by the step's shape: the simulator's model of a device.

Two kinds, one JSON file each (``load_profile``):

- ``linear`` (measured by ``flotilla bench profile`` on this machine):
  ``overhead_s + per_token_s x tokens + per_seq_s x seqs + per_prefill_s x
  prefills + per_context_token_s x context_tokens + per_prefill_pair_s x
  prefill_pairs``, fitted by least squares to timed steps; a CPU forward is
  compute-bound in its tokens, reads each sequence's KV once, and a prompt
  chunk takes another attention path than a decode row, quadratic in its
  length.
- ``roofline`` (a GPU preset, ``roofline_profile``): ``overhead_s +
  max(bytes / bandwidth, flops / peak)`` per step, where bytes are the
  weights read once plus every sequence's KV, and flops are ``2 x active
  params`` per token plus attention's ``4 x layers x heads x head_dim`` per
  (query, key) pair, divided over ``tp`` GPUs (the all-reduces between them
  are not counted). No measured GPU step exists yet (Step 23 replaces these
  with measured profiles).

A profile also carries the replica's capacity: KV pages, page size,
``max_num_seqs`` and ``max_num_batched_tokens``, which the simulated
replica's real scheduler runs with.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal, Protocol

from cli.plan.hardware import ModelArch, get_gpu, get_model, read_json_file
from cli.plan.planner import bytes_for, count_params, kv_bytes_per_token
from scheduling.errors import InvalidParameterError

ROOFLINE_OVERHEAD_S = 0.004  # a step's launches and host work on a GPU without CUDA graphs (vLLM-era figure)
ROOFLINE_MEMORY_FRACTION = 0.9  # of the GPU's memory, weights included, that the engine may use


@dataclass(frozen=True, slots=True)
class StepShape:
    """What a step's time depends on: query tokens, sequences, sequences prefilling (more than one query
    token: the attention path of a prompt chunk), KV tokens read, (query, key) pairs attended, and of those
    the pairs of prefilling sequences (quadratic in a chunk's length)."""

    tokens: int
    seqs: int
    prefills: int
    context_tokens: int
    attention_pairs: int
    prefill_pairs: int


@dataclass(frozen=True, slots=True)
class Capacity:
    """A replica's limits, as its engine config sets them."""

    num_kv_pages: int
    page_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096


class StepProfile(Protocol):
    """A step-time model and the replica capacity it was made for."""

    @property
    def kind(self) -> str:
        """``linear`` or ``roofline``."""
        ...

    @property
    def capacity(self) -> Capacity:
        """The replica's limits."""
        ...

    @property
    def host_cores(self) -> float | None:
        """Replicas' steps the host runs at full speed at once (measured on a shared host), else None."""
        ...

    @property
    def host_share_per_waiting(self) -> float:
        """With ``host_cores``: a waiting request's share of the host, as a fraction of a busy replica."""
        ...

    def step_seconds(self, shape: StepShape) -> float:
        """Seconds one step of ``shape`` takes."""
        ...

    def to_dict(self) -> dict[str, object]:
        """The JSON object ``load_profile`` reads back."""
        ...


@dataclass(frozen=True, slots=True)
class LinearProfile:
    """A fitted linear step-time model (module docstring)."""

    capacity: Capacity
    overhead_s: float
    per_token_s: float
    per_seq_s: float
    per_prefill_s: float
    per_context_token_s: float
    per_prefill_pair_s: float
    source: str = ""
    # How many replicas' steps the host runs at full speed at once (``bench profile --served
    # --host-replicas``); None: each replica has its own device. ``FleetConfig.host_cores`` overrides it.
    host_cores: float | None = None
    # With host_cores: what one request waiting in a replica's queue costs the host, as a share of a busy
    # replica (its open stream and queue entries; measured with host_cores).
    host_share_per_waiting: float = 0.0
    kind: Literal["linear"] = "linear"

    def step_seconds(self, shape: StepShape) -> float:
        return (self.overhead_s + self.per_token_s * shape.tokens + self.per_seq_s * shape.seqs
                + self.per_prefill_s * shape.prefills + self.per_context_token_s * shape.context_tokens
                + self.per_prefill_pair_s * shape.prefill_pairs)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class RooflineProfile:
    """A bandwidth/compute roofline of one model on ``tp`` GPUs (module docstring)."""

    capacity: Capacity
    weight_bytes: int
    kv_bytes_per_token: int
    active_params: int
    attention_flops_per_pair: int
    bandwidth_bytes_per_s: float
    peak_flops: float
    tp: int = 1
    overhead_s: float = ROOFLINE_OVERHEAD_S
    source: str = ""
    host_cores: None = None  # each replica has its own GPUs
    host_share_per_waiting: float = 0.0
    kind: Literal["roofline"] = "roofline"

    def step_seconds(self, shape: StepShape) -> float:
        read = self.weight_bytes + self.kv_bytes_per_token * shape.context_tokens
        flops = 2 * self.active_params * shape.tokens + self.attention_flops_per_pair * shape.attention_pairs
        return self.overhead_s + max(read / self.bandwidth_bytes_per_s, flops / self.peak_flops) / self.tp

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def roofline_profile(model: ModelArch | str, gpu: str, *, tp: int = 1, dtype: str = "bf16",
                     max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                     max_model_len: int = 8192, page_size: int = 16) -> RooflineProfile:
    """The roofline of ``model`` (a preset name or architecture) on ``tp`` x ``gpu``; its KV pages are what
    ``ROOFLINE_MEMORY_FRACTION`` of their memory holds beside the weights."""
    arch = get_model(model) if isinstance(model, str) else model
    spec = get_gpu(gpu)
    if not isinstance(tp, int) or tp < 1:
        raise InvalidParameterError("tp", f"must be an integer >= 1, got {tp!r}")
    params = count_params(arch)
    weights = bytes_for(params.total, dtype)
    kv_token = kv_bytes_per_token(arch, dtype)
    spare = int(tp * spec.memory_bytes * ROOFLINE_MEMORY_FRACTION) - weights
    pages = spare // (kv_token * page_size)
    if pages * page_size < max_model_len:
        raise InvalidParameterError("gpu", f"{arch.name} on {tp} x {spec.name}: {max(pages, 0) * page_size} tokens of KV "
                                           f"fit beside the weights, under max_model_len {max_model_len}")
    return RooflineProfile(
        capacity=Capacity(pages, page_size, max_num_seqs, max_num_batched_tokens, max_model_len),
        weight_bytes=weights, kv_bytes_per_token=kv_token, active_params=params.active,
        attention_flops_per_pair=4 * arch.num_layers * arch.num_heads * arch.head_dim,
        bandwidth_bytes_per_s=spec.bandwidth_bytes_per_s, peak_flops=spec.bf16_flops, tp=tp,
        source=f"roofline: {arch.name} on {tp} x {spec.name} ({dtype})")


def load_profile(path: Path) -> StepProfile:
    """A profile JSON file (``to_dict``'s object); a bad file is refused naming it."""
    data = read_json_file(path, "profile")
    try:
        capacity = Capacity(**data.pop("capacity"))
        kind = data.get("kind")
        if kind == "linear":
            return LinearProfile(capacity=capacity, **data)
        if kind == "roofline":
            return RooflineProfile(capacity=capacity, **data)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise InvalidParameterError("profile", f"{path}: not a step profile ({exc})") from None
    raise InvalidParameterError("profile", f"{path}: kind must be linear or roofline, got {kind!r}")
