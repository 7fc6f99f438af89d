"""The scheduler's side of speculative decoding: which sequences draft, how many tokens, and what was kept.

Per step, a decoding sequence may carry ``k`` draft tokens after its last
sampled token; the step computes all ``k + 1`` and samples at each, and the
longest prefix of drafts the sampler agrees with is kept, plus one token the
sampler chose (``actors.runner.spec_verify``). Where drafts come from:

- ``ngram``: proposed here, at schedule time, by prompt lookup
  (``scheduling.ngram_proposer``); no model runs.
- ``draft``: proposed by the model runner right after it samples (a draft
  model, or the target's first layers), returned with the step's output and
  kept on the request (``Request.drafts``, a ``DraftState``) for its next step. The
  scheduler tells the runner how many to propose per sampled sequence and
  reserves the pages their KV is written to.

Adaptive:

- a sequence whose acceptance over its last ``acceptance_window`` drafted
  steps fell below ``min_acceptance`` stops drafting for ``cooldown_tokens``
  generated tokens;
- a step drafts only while the engine's recent acceptance (an exponential
  average over verified drafts) is at least ``min_acceptance``, or
  ``busy_min_acceptance`` in a busy step (``busy_batch_size`` or more running
  sequences). In a big batch the forward is compute-bound: a draft token costs
  about what a real one does, so only drafts that are nearly always right pay.
  While the average is below the bar, one such step in ``PROBE_EVERY`` drafts
  anyway, so the average follows the workload (a burst of copy-heavy requests
  turns it back on), and a drafter that is never right costs little;
- a step with ``disable_by_batch_size`` or more running sequences drafts nothing.
"""

from __future__ import annotations

from scheduling.ngram_proposer import propose_ngram
from scheduling.request import DraftState, Request
from scheduling.request_pages import RequestPages
from scheduling.scheduler_stats import SchedulerStats
from scheduling.spec_config import SpeculativeConfig

# While the engine's acceptance is below the step's bar, one step in this many drafts, to measure it.
PROBE_EVERY = 32
# Weight of one verified draft in the engine's acceptance average (about the last 20 drafts count).
ACCEPTANCE_EMA_WEIGHT = 0.05


class SpecDecodePolicy:
    """Drafts for the scheduler, within each request's limits, and the adaptive off-switches."""

    def __init__(self, config: SpeculativeConfig, stats: SchedulerStats, max_model_len: int) -> None:
        self.config = config
        self.stats = stats
        self.max_model_len = max_model_len
        self.acceptance = 1.0  # the engine's recent acceptance; optimistic until drafts are verified
        self._held_steps = 0

    def start_step(self, num_running: int) -> bool:
        """Whether the step being planned drafts at all, from its batch size and recent acceptance."""
        cfg = self.config
        if cfg.disable_by_batch_size is not None and num_running >= cfg.disable_by_batch_size:
            return False
        bar = cfg.busy_min_acceptance if num_running >= cfg.busy_batch_size else cfg.min_acceptance
        if self.acceptance >= bar:
            return True
        self._held_steps += 1
        return self._held_steps % PROBE_EVERY == 0

    def _state(self, req: Request) -> DraftState:
        if req.drafts is None:
            req.drafts = DraftState()
        return req.drafts

    def max_drafts(self, req: Request) -> int:
        """Draft tokens worth verifying for ``req`` now (0 when it is cooling down).

        Every kept draft is an output token and one more is always sampled, so
        more than ``max_tokens - len(output) - 1`` could never all be used.
        """
        num_out = len(req.output_token_ids)
        state = self._state(req)
        if num_out < state.resume_at:
            return 0
        return max(0, min(self.config.num_speculative_tokens, req.params.max_tokens - num_out - 1))

    def drafts(self, req: Request, limit: int) -> list[int]:
        """Up to ``limit`` draft tokens to verify in ``req``'s next decode step."""
        cfg = self.config
        if cfg.drafts_in_runner:  # taken once, and discarded even when none are wanted: they go stale
            state = self._state(req)
            drafts, state.draft_token_ids = state.draft_token_ids, []
            if limit <= 0 or state.proposed_at != len(req.output_token_ids):
                return []
            return drafts[:limit]
        if limit <= 0:
            return []
        return propose_ngram(req.all_token_ids, limit, cfg.prompt_lookup_min, cfg.prompt_lookup_max)

    def num_to_propose(self, req: Request) -> int:
        """Drafts the runner should propose after this step (``draft`` method only).

        The step adds at least one output token, so at most ``max_tokens -
        len(output) - 2`` drafts could be verified next step.
        """
        if not self.config.drafts_in_runner:
            return 0
        num_out = len(req.output_token_ids)
        if num_out + 1 < self._state(req).resume_at:
            return 0
        return max(0, min(self.config.num_speculative_tokens, req.params.max_tokens - num_out - 2))

    def reserve(self, kv: RequestPages, req: Request, n: int, drafts: list[int]) -> tuple[list[int], int]:
        """Pages for ``req``'s drafts and proposals, from free pages only; else none of either.

        ``n`` tokens are computed this step before the drafts. Speculation is
        opportunistic: it never evicts cached prefixes or preempts a request,
        and the scheduler calls this only after every request of the step has
        its ordinary pages, so drafts never take a page another request needed.
        Proposing m drafts after the step computes m tokens from the new last
        one, at most m positions past the step's tokens, and stops short of
        ``max_model_len``. Returns the drafts to verify and how many to propose.
        """
        end = req.num_computed_tokens + n + len(drafts)  # context after this step
        propose = min(self.num_to_propose(req), self.max_model_len - end)
        if not drafts and propose <= 0:
            return [], 0
        if kv.reserve(req, end + max(propose, 0), evict=False):
            return drafts, max(propose, 0)
        return [], 0

    def record(self, req: Request, num_drafted: int, num_accepted: int) -> None:
        """Count a verified draft; start a cooldown when the request's recent acceptance is low."""
        self.stats.record_draft(num_drafted, num_accepted)
        self.acceptance += ACCEPTANCE_EMA_WEIGHT * (num_accepted / num_drafted - self.acceptance)
        state = self._state(req)
        cfg = self.config
        state.recent.append((num_drafted, num_accepted))
        if len(state.recent) > cfg.acceptance_window:
            state.recent.popleft()
        if len(state.recent) < cfg.acceptance_window:
            return
        drafted = sum(d for d, _ in state.recent)
        accepted = sum(a for _, a in state.recent)
        if accepted < cfg.min_acceptance * drafted:
            state.resume_at = len(req.output_token_ids) + cfg.cooldown_tokens
            state.recent.clear()

    def set_proposals(self, req: Request, draft_token_ids: list[int]) -> None:
        """Keep the runner's drafts for ``req``'s next step (they follow its current output)."""
        state = self._state(req)
        state.draft_token_ids = draft_token_ids
        state.proposed_at = len(req.output_token_ids)
