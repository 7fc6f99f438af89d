"""A generation request and its lifecycle.

Lifecycle (the only transitions allowed; ``Request.set_status`` is the one
place status changes)::

    WAITING -> RUNNING -> FINISHED | ABORTED
    RUNNING -> PREEMPTED -> WAITING
    WAITING | PREEMPTED -> ABORTED
"""

from __future__ import annotations

import enum
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from scheduling.finish_reason import FinishReason
from scheduling.lora_slots import cache_namespace
from scheduling.sampling_params import SamplingParams
from scheduling.stop_rule import StopRule

if TYPE_CHECKING:
    from kvcache.kv_transfer import RankPayloads
    from kvcache.radix_cache import RadixNode
    from scheduling.pooling import Pooling


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"
    ABORTED = "aborted"


_ALLOWED: dict[RequestStatus, frozenset[RequestStatus]] = {
    RequestStatus.WAITING: frozenset({RequestStatus.RUNNING, RequestStatus.ABORTED}),
    RequestStatus.RUNNING: frozenset(
        {RequestStatus.FINISHED, RequestStatus.ABORTED, RequestStatus.PREEMPTED}
    ),
    RequestStatus.PREEMPTED: frozenset({RequestStatus.WAITING, RequestStatus.ABORTED}),
    RequestStatus.FINISHED: frozenset(),
    RequestStatus.ABORTED: frozenset(),
}


# Each feature's per-request state is one record, defined here rather than in the feature's module
# (``scheduling.spec_decode``, ``scheduling.kv_tiers``, ...), which imports this one: so no module of
# scheduling/ names a type of a module that names it back. Mutable (slots) records: the scheduler and
# the engine update them in place step by step.


@dataclass(slots=True)
class DraftState:
    """One request's speculation (``scheduling.spec_decode``): drafts waiting for its next step and its
    recent acceptance."""

    draft_token_ids: list[int] = field(default_factory=list)
    # The output length the proposals follow: they are valid for the step right after they were made and
    # stale once any token is added without them (a step that did not draft, a cooldown, a preemption).
    proposed_at: int = -1
    # (drafted, accepted) of its last drafted steps, at most acceptance_window of them.
    recent: deque[tuple[int, int]] = field(default_factory=deque)
    # The output length from which it may draft again after a cooldown.
    resume_at: int = 0


@dataclass(frozen=True, slots=True)
class TierHit:
    """Blocks a tier returned for a waiting request: its pages ``first_page ..`` (one payload per rank)."""

    first_page: int
    payload: RankPayloads

    @property
    def num_pages(self) -> int:
        return self.payload[0].num_pages


@dataclass(slots=True)
class RequestKVMoves:
    """A request's KV that leaves for or arrives from elsewhere (``Batch.kv_moves``).

    Prefill/decode handoff (``scheduling.kv_handoff``): a prefill-only
    request's prompt KV leaves with the step that samples its first token
    (``export``); a request whose prompt KV was computed elsewhere carries it
    (``imported``, one payload per tensor-parallel rank) until the step that
    admits it writes it. KV tiers (``scheduling.kv_tiers``): a tier load is
    out for its prefix (``loading``: admission waits for it); the blocks it
    brought (``loaded``), until admission takes them; pages filled from them
    not yet written (``tier_unwritten``).
    """

    export: bool = False
    imported: RankPayloads | None = None
    loading: bool = False
    loaded: TierHit | None = None
    tier_unwritten: bool = False


@dataclass(slots=True)
class RequestLoRA:
    """A request's adapter slot (``scheduling.lora_slots``)."""

    slot: int | None = None  # the slot it pins while running
    overtakes: int = 0  # steps in which later requests were admitted while it waited for a slot


class Request:
    """One sequence being generated.

    ``num_computed_tokens`` counts tokens whose KV is in ``pages``; the next
    step computes ``num_tokens - num_computed_tokens`` of them (all the prompt,
    a chunk of it, or the one token sampled last step).
    """

    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "params",
        "sampler_params",
        "pooling",
        "namespace",
        "cache_namespace",
        "lora",
        "stop_rule",
        "status",
        "output_token_ids",
        "num_computed_tokens",
        "num_cached_tokens",
        "num_preemptions",
        "pages",
        "prefix_node",
        "finish_reason",
        "arrival_time",
        "first_scheduled_time",
        "first_token_time",
        "last_token_time",
        "drafts",
        "kv_moves",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        namespace: str | None = None,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
        stop_rule: StopRule | None = None,
        lora_key: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.sampler_params = params.sampler_view()  # what a batch carries to the sampler
        # An embedding request (``params.pooling``): it computes its prompt, never samples, never reads
        # nor fills the prefix cache, and ends once its prompt is computed (``BatchPolicy.update``).
        self.pooling: Pooling | None = params.pooling
        self.namespace = namespace
        # The prefix-cache tree this request reads and fills (and the seed of its KV tier keys): its
        # namespace, and the weights of its adapter (params.lora): ``lora_key``, the digest the engine's
        # registry has for it; a scheduler without an engine (tests, the simulator) keys by the name.
        self.cache_namespace = cache_namespace(namespace, lora_key if lora_key is not None else params.lora)
        self.lora = RequestLoRA()
        # When this sequence stops (and its text): the engine passes one with its detokenizer;
        # otherwise ``eos_token_id`` and ``params`` decide on tokens alone.
        self.stop_rule = StopRule(params, eos_token_id) if stop_rule is None else stop_rule
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        self.pages: list[int] = []
        self.prefix_node: RadixNode | None = None
        self.finish_reason: FinishReason | None = None
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.drafts: DraftState | None = None  # speculative decoding's, from its first drafted step
        self.kv_moves = RequestKVMoves()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status in (RequestStatus.FINISHED, RequestStatus.ABORTED)

    def append_output(self, tokens: list[int]) -> tuple[list[int], str, FinishReason | None]:
        """Append sampled ``tokens`` through the ``StopRule`` (the one stop rule), up to the one that stops it.

        Returns the tokens appended, the text they make safe to emit, and the
        finish reason (None while the sequence runs on).
        """
        out = self.output_token_ids
        if len(tokens) == 1:  # one new token (no drafts kept): the common case
            out.append(tokens[0])
            text, reason = self.stop_rule.on_token(tokens[0], len(out))
            return tokens, text, reason
        texts: list[str] = []
        reason = None
        for count, token in enumerate(tokens, 1):
            out.append(token)
            piece, reason = self.stop_rule.on_token(token, len(out))
            texts.append(piece)
            if reason is not None:
                return tokens[:count], "".join(texts), reason
        return tokens, "".join(texts), reason

    def set_status(self, status: RequestStatus) -> None:
        """Move along the lifecycle; anything else is a scheduler bug."""
        if status not in _ALLOWED[self.status]:
            raise RuntimeError(
                f"request {self.request_id}: illegal transition {self.status.value} -> {status.value}"
            )
        self.status = status

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, prompt={self.num_prompt_tokens}, "
            f"out={len(self.output_token_ids)}, computed={self.num_computed_tokens})"
        )
