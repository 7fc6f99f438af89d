"""One simulated replica: the real ``BatchPolicy`` over a real ``PageAllocator``, stepped in simulated time.

A step is what ``BatchPolicy.schedule`` returns; instead of a forward, the
profile says how long it takes (``StepShape`` from the batch), and every
sampled row gets token 0 (requests run ``ignore_eos`` to their
``output_tokens``, so the token's value changes nothing). ``BatchPolicy.update``
then applies it exactly as after a real step: chunked prefill, admission,
preemption and page accounting are the engine's own. Prompts are token ids
with no shared prefix (a trace gives lengths only), so prefix caching is off.

Latency: each finished request's ``SequenceTiming`` in simulated seconds
feeds the replica's recent window (``cluster.autoscaling_metrics``'s: the last 10 s),
which the autoscaler reads, as a real replica's does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from actors.api import FinishReason, LatencyWindow, SequenceDelta, SequenceTiming
from cli.bench.stream_client import RequestResult
from cli.simulate.profile import StepProfile, StepShape
from cluster.autoscaling_metrics import ReplicaLoad, recent_latency_window
from kvcache.page_allocator import PageAllocator
from scheduling.batch import Batch, StepOutput
from scheduling.policy import BatchPolicy
from scheduling.request import Request
from scheduling.sampling_params import SamplingParams
from scheduling.scheduler_config import SchedulerConfig


@dataclass(slots=True)
class Tracked:
    """A request's simulated timeline."""

    arrival: float
    prompt_tokens: int
    first_token: float | None = None
    last_token: float | None = None
    produced: int = 0


@dataclass
class SimReplica:
    """A replica from when it is ready until it is removed (``stopped``)."""

    name: str
    profile: StepProfile
    started: float  # asked for (replica-seconds count from here)
    ready_at: float
    draining: bool = False
    stopped: float | None = None
    busy_until: float | None = None  # the running step's end; None: idle
    window: LatencyWindow = field(default_factory=recent_latency_window)
    tracked: dict[str, Tracked] = field(default_factory=dict)
    kv_peak: float = 0.0
    steps: int = 0

    def __post_init__(self) -> None:
        cap = self.profile.capacity
        config = SchedulerConfig(max_model_len=cap.max_model_len, max_num_seqs=cap.max_num_seqs,
                                 max_num_batched_tokens=cap.max_num_batched_tokens, page_size=cap.page_size,
                                 enable_prefix_caching=False)
        self.policy = BatchPolicy(config, PageAllocator(cap.num_kv_pages))
        self._batch: Batch | None = None

    @property
    def open_requests(self) -> int:
        return len(self.tracked)

    def add(self, rid: str, prompt_tokens: int, output_tokens: int, now: float) -> None:
        """Queue a request (its lengths were checked against ``max_model_len`` by the fleet)."""
        params = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True)
        self.policy.add(Request(rid, [0] * prompt_tokens, params))
        self.tracked[rid] = Tracked(now, prompt_tokens)

    def add_prefilled(self, rid: str, prompt_tokens: int, output_tokens: int, arrival: float,
                      first_token_at: float) -> None:
        """Queue a request prefilled on another replica: its first token is out (at ``first_token_at``) and its
        prompt's KV arrives with it, so the scheduler imports the pages instead of computing them
        (``scheduling.kv_handoff.take_imported``, as ``actors.engine.disaggregation.add_prefilled`` sets up)."""
        params = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True)
        req = Request(rid, [0] * prompt_tokens, params)
        req.append_output([0])
        req.kv_moves.imported = ()  # the payload's bytes are the simulator's hand-off time, not data
        self.policy.add(req)
        self.tracked[rid] = Tracked(arrival, prompt_tokens, first_token=first_token_at, last_token=first_token_at,
                                    produced=1)

    def start_step(self, now: float, slowdown: Callable[[], float] | None = None) -> float | None:
        """Schedule a step at ``now``, taking ``slowdown()`` times the profile's time (replicas sharing a host's
        cores; asked once the step is scheduled, so its requests no longer wait); its end time, or None when
        there is nothing to run."""
        batch = self.policy.schedule()
        if batch is None:
            self.busy_until = None
            return None
        pairs = prefill_pairs = prefills = 0
        for q, ctx in zip(batch.query_lens, batch.context_lens, strict=True):
            pairs += q * ctx
            if q > 1:
                prefills += 1
                prefill_pairs += q * ctx
        shape = StepShape(tokens=batch.num_tokens, seqs=batch.num_seqs, prefills=prefills,
                          context_tokens=sum(batch.context_lens), attention_pairs=pairs, prefill_pairs=prefill_pairs)
        self._batch = batch
        self.steps += 1
        self.busy_until = now + self.profile.step_seconds(shape) * (slowdown() if slowdown is not None else 1.0)
        return self.busy_until

    def finish_step(self, now: float) -> list[tuple[str, RequestResult]]:
        """Apply the running step at its end ``now``; the requests it finished (id, outcome)."""
        batch, self._batch = self._batch, None
        assert batch is not None, "finish_step without a step"
        self.busy_until = None
        update = self.policy.update(batch, StepOutput(token_ids=[0] * len(batch.sample_indices),
                                                         logprobs=[None] * len(batch.sample_indices)))
        for req, tokens, _, _ in update.sampled:
            t = self.tracked[req.request_id]
            if t.first_token is None:
                t.first_token = now
            t.last_token = now
            t.produced += len(tokens)
        done: list[tuple[str, RequestResult]] = []
        deltas: list[SequenceDelta] = []
        for req in update.finished:
            t = self.tracked.pop(req.request_id)
            assert t.first_token is not None and t.last_token is not None
            timing = SequenceTiming(t.arrival, t.first_token, t.last_token, t.produced)
            deltas.append(SequenceDelta(request_id=req.request_id, index=0, token_ids=[], text="", logprobs=None,
                                        finish_reason=FinishReason.LENGTH, timing=timing))
            done.append((req.request_id, RequestResult(
                True, start_s=t.arrival, ttft_s=timing.ttft_s, e2e_s=timing.e2e_s, prompt_tokens=t.prompt_tokens,
                output_tokens=t.produced, finish_reasons=[FinishReason.LENGTH.value])))
        self.window.observe(deltas, now)
        alloc = self.policy.allocator
        self.kv_peak = max(self.kv_peak, 1 - alloc.num_free_pages / alloc.num_pages)
        return done

    def load(self, now: float) -> ReplicaLoad:
        """What this replica reports to the autoscaler now (``cluster.autoscaling_metrics``)."""
        s = self.policy
        alloc = s.allocator
        idle = not self.tracked  # as a real replica reports: no request waiting here, no latency to speak of
        return ReplicaLoad(
            num_waiting=float(len(s.waiting)), num_running=float(len(s.running)),
            kv_usage=1 - alloc.num_free_pages / alloc.num_pages,
            ttft_p95_ms=0.0 if idle else self.window.ms("ttft", 95, now),
            tpot_p95_ms=0.0 if idle else self.window.ms("tpot", 95, now),
            num_waiting_prompt_tokens=float(sum(r.num_prompt_tokens - r.num_computed_tokens for r in s.waiting)),
        )
