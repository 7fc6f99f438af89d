"""The types that cross between the engine and what serves it: the replica's one door.

The HTTP replica (``apps/``) and the fleet policy (``cluster/``) read the
engine only through what is defined or re-exported here (plus
``actors.config``, ``actors.errors`` and the scheduler handle in
``actors.scheduler``; tests/test_layering.py holds them to it):

- per step, ``SequenceDelta`` (with a finished sequence's ``SequenceTiming``)
  in ``StepMessage``s, and a whole request as ``RequestOutput``;
- ``FinishReason``, why a sequence ended;
- ``HealthStatus``, ``EngineStats`` and ``LatencyWindow`` (the one latency view);
- the prefill/decode contract: ``PrefillResult`` and what both pools must share;
- ``LoRAInfo``, what loading an adapter reports.

Only light modules are imported (no torch, no engine), and every module
of the engine may import this one: the arrows run from the engine's
folders to here, never back.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeAlias

from actors.tokenizing import bytes_to_unicode, chat_ids, template_supports_tools, text_ids
from scheduling.batch import TokenLogprobs
from scheduling.errors import InvalidParameterError
from scheduling.finish_reason import FinishReason
from scheduling.spec_config import SpeculativeConfig

if TYPE_CHECKING:  # only named in annotations: the replica imports neither torch nor Ray for these
    from ray import ObjectRef

    from kvcache.kv_transfer import RankPayloads

__all__ = [
    "WEIGHT_QUANTIZATION_FIELDS",
    "CompletionOutput",
    "EngineStats",
    "FinishReason",
    "HealthStatus",
    "LatencyWindow",
    "LoRAInfo",
    "PrefillResult",
    "RankPayloadsOrRef",
    "RequestOutput",
    "SequenceDelta",
    "SequenceTiming",
    "StepMessage",
    "WeightQuantization",
    "check_decode_drafting",
    "percentile",
    # Re-exported (defined in ``actors.tokenizing``): the replica tokenizes prompts and reads token
    # text back exactly as the engine does, through this door.
    "bytes_to_unicode",
    "chat_ids",
    "template_supports_tools",
    "text_ids",
]


# ---------------------------------------------------------------- per-step and finished outputs
@dataclass(frozen=True, slots=True)
class SequenceTiming:
    """When a sequence arrived and produced tokens, on the engine's monotonic clock.

    Only differences are meaningful (the clock is the engine process's
    ``time.monotonic``), which is why the derived latencies are offered too.
    """

    arrival_time: float
    first_token_time: float | None
    last_token_time: float | None
    num_output_tokens: int
    first_scheduled_time: float | None = None  # when it first entered a batch

    @property
    def queue_time_s(self) -> float | None:
        """Time spent waiting before first being scheduled, or None if it never was."""
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def e2e_s(self) -> float | None:
        """Arrival to last token, or None if no token was produced."""
        if self.last_token_time is None:
            return None
        return self.last_token_time - self.arrival_time

    @property
    def ttft_s(self) -> float | None:
        """Time to first token, or None if no token was produced."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first, or None with fewer than two."""
        if self.first_token_time is None or self.last_token_time is None or self.num_output_tokens < 2:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_output_tokens - 1)


@dataclass(frozen=True, slots=True, kw_only=True)
class SequenceDelta:
    """What one sequence gained in one step (one message carries a list of these).

    Built by keyword only: ten fields, several of the same type, in four places.
    ``index`` is the sequence's place among the request's ``n``.
    ``finish_reason`` is set on the sequence's last delta; with
    ``FinishReason.ERROR``, ``error`` says what went wrong.
    ``timing`` is set on the last delta only (one object per finished
    sequence keeps the per-step message small).
    ``embedding``: an embedding request's (``SamplingParams.pooling``) pooled
    vector. Such a request yields exactly one delta, in the step that
    computes its prompt's last token: no tokens, no text, finish reason
    "stop", its prompt length, the vector, and timing whose
    ``first_token_time`` is None (no token: TTFT figures leave it out) and
    whose ``last_token_time`` is when the vector was ready (``e2e_s``); or,
    ended early, the usual "abort"/"error" delta without a vector.
    """

    request_id: str
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs] | None
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    timing: SequenceTiming | None = None
    embedding: list[float] | None = None


@dataclass(slots=True)
class CompletionOutput:
    """One generated sequence, accumulated.

    ``embedding``: for an embedding request (``SamplingParams.pooling``), its
    pooled vector once finished (``text`` and ``token_ids`` stay empty); None
    for a generating request, or one that ended without it (abort, error).
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: FinishReason | None = None
    error: str | None = None
    embedding: list[float] | None = None


@dataclass(slots=True)
class RequestOutput:
    """A finished request: its prompt and its ``n`` sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)

    def apply(self, delta: SequenceDelta) -> None:
        """Fold one step's delta into the accumulated output."""
        out = self.outputs[delta.index]
        out.text += delta.text
        out.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            if out.logprobs is None:
                out.logprobs = []
            out.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            out.finish_reason = delta.finish_reason
            out.error = delta.error
        if delta.embedding is not None:
            out.embedding = delta.embedding
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)


# ---------------------------------------------------------------- the scheduler actor's messages
@dataclass(frozen=True, slots=True)
class StepMessage:
    """Every delta one consumer's requests gained in engine steps ``first_step..last_step``.

    The output channel carries ONE of these per engine step per consumer
    (``actors.scheduler.output_router``), never one Ray object per token per
    request. Normally ``first_step == last_step``. When a consumer falls
    behind by more than the actor's queue bound, the newest messages are
    merged (deltas concatenated in order), so nothing is lost and memory
    stays bounded by the tokens themselves. Abort and fault notices arrive
    in messages of their own, with the number of the last step run.
    """

    first_step: int
    last_step: int
    deltas: list[SequenceDelta]


@dataclass(frozen=True, slots=True)
class HealthStatus:
    """Whether the replica can serve; ``message`` says why not (or "ok")."""

    ok: bool
    message: str
    restarting: bool = False


# ---------------------------------------------------------------- stats
def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation; 0.0 when empty."""
    if not values:
        return 0.0
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


class LatencyWindow:
    """TTFT and TPOT samples (seconds) of recently finished sequences: the one latency view.

    Every figure comes from the sequence's ``SequenceTiming`` (its ``ttft_s``
    and ``tpot_s``, the one definition), so the scheduler actor's window, the
    replica's and the Prometheus histograms (``cluster.metrics``) agree on
    what TTFT and TPOT mean. Only sequences that ended normally
    (``FinishReason.completed``) count: an aborted or failed one would skew
    the latency a healthy request sees. The window keeps the last ``size``
    samples and, with ``max_age_s``, only those observed in the last
    ``max_age_s`` seconds (``now`` is the caller's monotonic clock).
    """

    def __init__(self, size: int = 1024, max_age_s: float | None = None) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.max_age_s = max_age_s
        self._samples: deque[tuple[float, float | None, float | None]] = deque(maxlen=size)

    def observe(self, deltas: list[SequenceDelta], now: float | None = None) -> None:
        """Record the timings carried by finishing deltas (others carry none)."""
        for d in deltas:
            t = d.timing
            if t is not None and d.finish_reason is not None and d.finish_reason.completed:
                self._samples.append((time.monotonic() if now is None else now, t.ttft_s, t.tpot_s))

    def ms(self, which: str, q: float, now: float | None = None) -> float:
        """Percentile ``q`` of ``"ttft"`` or ``"tpot"`` in milliseconds; 0.0 with no sample."""
        if self.max_age_s is not None:
            oldest = (time.monotonic() if now is None else now) - self.max_age_s
            while self._samples and self._samples[0][0] < oldest:
                self._samples.popleft()
        column = 1 if which == "ttft" else 2
        values = [v for sample in self._samples if (v := sample[column]) is not None]
        return round(percentile(values, q) * 1000.0, 3)


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of one replica's engine (``SchedulerActor.stats``; taken by ``actors.engine.stats.snapshot``).

    KV accounting: every page is exactly one of free, cached (held only by
    the prefix cache: ``num_kv_pages_evictable`` of them can be reclaimed at
    once, ``num_kv_pages_locked`` are pinned by running requests' matched
    prefixes) or owned by running requests. With no request in flight,
    ``num_kv_pages_free + num_kv_pages_evictable == num_kv_pages_total``.
    """

    num_waiting: int
    num_running: int
    num_unfinished_requests: int
    num_kv_pages_total: int
    num_kv_pages_free: int
    num_kv_pages_used: int
    num_kv_pages_evictable: int
    num_kv_pages_locked: int
    prefix_cache_hit_rate: float
    num_preemptions: int
    num_steps: int
    ttft_ms_p50: float
    ttft_ms_p95: float
    tpot_ms_p50: float
    tpot_ms_p95: float
    # Cumulative prompt tokens looked up in / found in the prefix cache (first admission only).
    prefix_cache_queries_tokens: int = 0
    prefix_cache_hits_tokens: int = 0
    # The snapshotting process: resident set now and at its peak, the memory it
    # may use (cgroup limit or physical RAM, whichever is lower), CPU seconds used.
    memory_used_bytes: int = 0
    memory_peak_bytes: int = 0
    memory_limit_bytes: int = 0
    cpu_seconds_total: float = 0.0
    # Seconds the engine spent in forwards (``LLMEngine.forward_seconds_total``); per step, with num_steps.
    forward_seconds_total: float = 0.0
    # The device this process drives (None without CUDA): memory in use on it
    # (by every process), its size, and its utilisation over the last sample period.
    gpu_memory_used_bytes: int | None = None
    gpu_memory_total_bytes: int | None = None
    gpu_utilization_perc: float | None = None
    # time.time() when taken, so a reader can turn cpu_seconds_total into a rate.
    wall_time: float = 0.0
    # Speculative decoding, cumulative (``SchedulerStats.record_draft``; all zero without it):
    # drafts verified, draft tokens proposed and accepted, and per draft position i the
    # drafts whose token i was accepted. A tuple, so the frozen snapshot shares no list.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()
    # Structured output, cumulative: requests by constraint kind, seconds of the step spent on masks,
    # constraints compiled and the durations of the most recent compiles (``GrammarCompiler.compile_seconds``).
    structured_output_requests: tuple[tuple[str, int], ...] = ()
    structured_output_step_seconds: float = 0.0
    grammar_compiles_total: int = 0
    grammar_compile_seconds_recent: tuple[float, ...] = ()
    # Prompt tokens the waiting requests still have to compute (prefill load; P/D's prefill pool scales on it).
    num_waiting_prompt_tokens: int = 0
    # LoRA (``actors.engine.lora_registry``): per loaded adapter, requests admitted (cumulative) and
    # seconds its load took; adapters in the engine now (loaded, not unloading).
    lora_requests: tuple[tuple[str, int], ...] = ()
    lora_load_seconds: tuple[tuple[str, float], ...] = ()
    lora_adapters: tuple[str, ...] = ()
    # KV tiers (``actors.engine.kv_tiers``; empty when off): per tier (host, disk, cluster, and the
    # engine's own counts) its cumulative counters and holdings (``kvcache.kv_tiers.TierStats``).
    kv_tiers: tuple[tuple[str, tuple[tuple[str, float], ...]], ...] = ()
    # Mixture of experts (``ReadExpertTokens``; empty for a dense model or when unread): per MoE layer,
    # in layer order, per expert, the tokens routed to it since the model loaded (each token counts top_k times).
    moe_expert_tokens: tuple[tuple[int, ...], ...] = ()


# ---------------------------------------------------------------- prefill/decode disaggregation
# A ``PrefillResult``'s KV as it travels: the payloads, or on Ray an ``ObjectRef`` to them.
RankPayloadsOrRef: TypeAlias = "RankPayloads | ObjectRef[RankPayloads]"
# An engine's ``(quantization, quantization_group_size)``: with the model, what computed its KV.
WeightQuantization: TypeAlias = tuple[str | None, int | None]
WEIGHT_QUANTIZATION_FIELDS = ("quantization", "quantization_group_size")  # the EngineConfig fields of one


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """A prompt computed on a prefill replica: its first token and its KV (one payload per rank)."""

    request_id: str
    first_token: int
    first_logprobs: TokenLogprobs | None
    # On Ray an ObjectRef to the payloads, so the pages are copied into the object store once and
    # only the ref passes the replicas between; the decode side fetches them before ``add_prefilled``.
    kv: RankPayloadsOrRef
    num_prompt_tokens: int
    num_cached_tokens: int
    kv_bytes: int
    prefill_s: float  # queued + computed on the prefill replica, export included
    quantization: WeightQuantization  # the prefill engine's (``actors.engine.disaggregation.weight_quantization``)


def check_decode_drafting(speculative_config: SpeculativeConfig | dict[str, Any] | str | None) -> None:
    """Refuse a separate draft model where requests arrive prefilled (a decode replica or pool).

    Only the target model's KV moves between replicas: the draft model's own
    pool would hold nothing for an imported prompt, and its drafts would be
    blind. N-gram drafting and a self-draft (``layers``, on the target's
    pages) see the imported KV and are kept.
    """
    spec = SpeculativeConfig.parse(speculative_config)
    if spec is not None and spec.model is not None:
        raise InvalidParameterError(
            "speculative_config.model",
            f"the draft model {spec.model!r} drafts from a KV pool of its own, which a prompt prefilled on "
            f"another replica never fills: a decode replica drafts with method 'ngram' or a self-draft "
            f"('layers'), or not at all",
        )


# ---------------------------------------------------------------- LoRA
@dataclass(frozen=True)
class LoRAInfo:
    """What ``LoRAManager.add`` reports about an adapter (the API lists it)."""

    name: str
    path: str
    rank: int
    targets: tuple[str, ...]
    key: str  # the digest of the files read (``actors.load.weights_digest``): what its cached KV is keyed by
