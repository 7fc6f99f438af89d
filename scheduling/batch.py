"""The plain data the scheduler hands to the model runner for one engine step.

The model runner never sees a ``Request``: everything it needs is here, as
lists of ints, so a ``Batch`` pickles cheaply for one Ray call per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from scheduling.sampling_params import SamplingParams

if TYPE_CHECKING:  # names only: scheduling does not import torch at run time
    import torch

    from kvcache.kv_transfer import KVPayload, RankPayloads


@dataclass(frozen=True, slots=True)
class TokenMasks:
    """The tokens some sampled rows may take (structured output, ``actors.grammar``).

    ``rows`` are indices into the step's sampled rows (one per sampled
    sequence, or ``1 + len(drafts)`` with drafts: ``actors.runner.spec_verify``), in
    increasing order. ``bitmask`` is an int32 tensor ``(len(rows), ceil(vocab
    / 32))``: token t is allowed in row i when bit ``t % 32`` of word ``t //
    32`` is set.
    """

    rows: list[int]
    bitmask: torch.Tensor


@dataclass(frozen=True, slots=True)
class BatchDrafts:
    """Speculative decoding's part of a step (``scheduling.spec_decode``), per sampled sequence (aligned with
    ``Batch.sample_indices``).

    ``token_ids[j]`` are the last ``len(token_ids[j])`` new tokens of sampled
    sequence j, drafts to verify: it samples at each of its last ``1 +
    len(token_ids[j])`` tokens (None: nothing to verify this step).
    ``num_propose[j]``: draft tokens the runner proposes for sequence j's next
    step (the ``draft`` method); its pages already cover ``context_lens +
    num_propose`` tokens (None: no proposals asked).
    """

    token_ids: list[list[int]] | None = None
    num_propose: list[int] | None = None


@dataclass(frozen=True, slots=True)
class BatchKVMoves:
    """The KV pages that leave the pool or arrive in it with a step: prefill/decode handoff
    (``scheduling.kv_handoff``) and the KV tiers (``scheduling.kv_tiers``).

    ``exports``: per sampled sequence whose prompt KV leaves with this step,
    (its index in ``sample_indices``, the pages holding its prompt); the runner
    copies them out after the forward. ``imports``: per sequence whose KV
    arrived from elsewhere (a prefill replica, or a tier), (the pages to fill,
    one ``KVPayload`` per tensor-parallel rank); the runner writes them before
    the forward. ``saves``: pages for the tiers, copied out before anything
    else of the step (imports, forward) writes the pool, and ``save_keys``
    (aligned) each one's block key (for the engine; the runner ignores them).
    """

    exports: list[tuple[int, list[int]]] | None = None
    imports: list[tuple[list[int], RankPayloads]] | None = None
    saves: list[int] | None = None
    save_keys: list[bytes] | None = None


@dataclass(frozen=True, slots=True)
class BatchLoRA:
    """LoRA's part of a step (``scheduling.lora_slots``).

    ``slots``: each sequence's adapter slot (-1: the base model), None when no
    sequence of the step has an adapter; ``loads``: (slot, adapter name) to
    write into the runner's slots before this step's forward.
    """

    slots: list[int] | None = None
    loads: list[tuple[int, str]] | None = None


@dataclass(frozen=True, slots=True)
class BatchPooling:
    """Embedding requests' part of a step (``scheduling.pooling``); both None when no sequence is pooled.

    ``indices`` lists, in increasing order, the sequences whose hidden rows of
    this step the runner pools; ``means[j]`` (aligned): True, the sum of every
    row the step computes for it (mean pooling, one chunk at a time); False,
    its last row only (last pooling: the step's chunk ends its prompt). A
    pooled sequence is never in ``sample_indices``.
    """

    indices: list[int] | None = None
    means: list[bool] | None = None


@dataclass(frozen=True, slots=True)
class Batch:
    """One engine step.

    Sequences appear in a fixed order; per-sequence lists are aligned with it.
    Token-level lists (``input_ids``, ``positions``) are the concatenation of
    every sequence's new tokens in that order.

    Invariants:
      - ``len(input_ids) == len(positions) == sum(query_lens)``
      - ``context_lens[i]`` = tokens in the KV cache for sequence i once this
        step's tokens are written (already computed + ``query_lens[i]``)
      - ``page_tables[i]`` covers ``context_lens[i]`` tokens
        (``ceil(context_lens[i] / page_size)`` pages, maybe more)
      - ``sample_indices`` lists, in increasing order, the sequences whose last
        new token produces a sampled token this step (a chunk that does not end
        its prompt samples nothing); the sampling lists are aligned with it.

    The core fields (those the invariants name) are always set; each
    feature's part of the step is one record (``drafts``, ``kv_moves``, ``lora``, ``pooling``), whose
    fields are None when the feature has nothing in this step (the default
    record: every field None).
    """

    step: int
    input_ids: list[int]
    positions: list[int]
    query_lens: list[int]
    context_lens: list[int]
    page_tables: list[list[int]]
    sample_indices: list[int]
    sampling_params: list[SamplingParams]  # sampler views (``SamplingParams.sampler_view``), shared when equal
    # Tokens generated so far by each sampled sequence, counted: seeds the
    # per-request generator so seeded sampling ignores batch composition.
    num_output_tokens: list[int]
    # Only for sampled sequences whose params apply penalties (else None): the
    # prompt and the tokens generated so far.
    prompt_token_ids: list[list[int] | None]
    output_token_ids: list[list[int] | None]
    drafts: BatchDrafts = BatchDrafts()
    token_masks: TokenMasks | None = None  # set by the engine when constrained sequences sample
    kv_moves: BatchKVMoves = BatchKVMoves()
    lora: BatchLoRA = BatchLoRA()
    pooling: BatchPooling = BatchPooling()

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def is_decode_only(self) -> bool:
        return len(self.input_ids) == len(self.query_lens)


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """Logprob of the chosen token and the top alternatives at one position."""

    token_id: int
    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What the model runner returns for one ``Batch``.

    ``token_ids`` and ``logprobs`` hold one row per sampled position: one per
    sampled sequence, in ``sample_indices`` order, except that a sequence with
    ``k`` drafts has ``k + 1`` rows (the token sampled at each of its last
    ``k + 1`` positions). ``num_accepted[j]`` (per sampled sequence; None when
    the batch has no drafts): how many of sequence j's drafts were kept; its
    new tokens are then its first ``num_accepted[j] + 1`` rows (the kept drafts,
    which equal the rows sampled at them, and the token sampled after the last
    one kept). ``draft_token_ids[j]``: drafts proposed for sequence j's next
    step (None unless the batch asked for proposals).
    """

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    num_accepted: list[int] | None = None
    draft_token_ids: list[list[int]] | None = None
    # Aligned with ``Batch.kv_moves.exports``: from a runner, this rank's ``KVPayload`` of each; from an
    # executor, a tuple of every rank's payload (rank order) of each.
    kv_exports: list[KVPayload] | list[RankPayloads] | None = None
    # The pages of ``Batch.kv_moves.saves``: this rank's payload (runner) or every rank's (executor).
    kv_saves: KVPayload | RankPayloads | None = None
    # Aligned with ``Batch.pooling.indices`` (rank 0 only): a float32 host tensor (len(indices), hidden),
    # row j the sum of sequence j's hidden rows of the step, or its last row (``Batch.pooling.means``).
    pooled: torch.Tensor | None = None
