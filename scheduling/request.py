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
from typing import TYPE_CHECKING

from scheduling.lora_slots import cache_namespace
from scheduling.sampling_params import SamplingParams
from scheduling.stop_rule import StopRule

if TYPE_CHECKING:
    from kvcache.kv_transfer import RankPayloads
    from kvcache.radix_cache import RadixNode
    from scheduling.kv_tiers import TierHit
    from scheduling.pooling import Pooling
    from scheduling.spec_decode import DraftState


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
        "lora_slot",
        "lora_overtakes",
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
        "spec",
        "export_kv",
        "kv_import",
        "kv_loading",
        "kv_loaded",
        "kv_tier_unwritten",
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
        # nor fills the prefix cache, and ends once its prompt is computed (``Scheduler.update``).
        self.pooling: Pooling | None = params.pooling
        self.namespace = namespace
        # The prefix-cache tree this request reads and fills (and the seed of its KV tier keys): its
        # namespace, and the weights of its adapter (params.lora): ``lora_key``, the digest the engine's
        # registry has for it; a scheduler without an engine (tests, the simulator) keys by the name.
        self.cache_namespace = cache_namespace(namespace, lora_key if lora_key is not None else params.lora)
        self.lora_slot: int | None = None  # the LoRA slot it pins while running (``scheduling.lora_slots``)
        self.lora_overtakes = 0  # steps in which later requests were admitted while it waited for a slot
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
        self.finish_reason: str | None = None
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.spec: DraftState | None = None  # speculative decoding's per-request state
        # Prefill/decode disaggregation: a prefill-only request's prompt KV leaves with the step that
        # samples its first token (``export_kv``); a request whose prompt KV was computed elsewhere
        # carries it (one payload per tensor-parallel rank) until the step that admits it writes it.
        self.export_kv = False
        self.kv_import: RankPayloads | None = None
        # KV tiers (``scheduling.kv_tiers``): a tier load is out for its prefix (admission waits for it);
        # the blocks it brought, until admission takes them; pages filled from them not yet written.
        self.kv_loading = False
        self.kv_loaded: TierHit | None = None
        self.kv_tier_unwritten = False

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

    def append_output(self, tokens: list[int]) -> tuple[list[int], str, str | None]:
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
