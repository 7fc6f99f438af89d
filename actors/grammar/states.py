"""One grammar matcher per constrained sequence: the masks each step samples with, and the tokens it kept.

A matcher's state is always "after every output token of its sequence", so
nothing is rolled back when a sequence is preempted (its output is kept and
recomputed) and a prefix-cache hit changes nothing. Drafts are the one
look-ahead: the mask of a sequence's row r depends on its drafts before r,
so ``masks`` feeds them through the matcher, fills each row, then rolls the
matcher back; ``accept`` then advances it by the tokens the step kept.

Rows after a draft the grammar refuses get no mask: the row before it only
samples allowed tokens, so it never agrees with that draft and the rows
after it are discarded. Likewise after a draft that completes the output.
"""

from __future__ import annotations

import xgrammar as xgr

from scheduling.batch import Batch, TokenMasks


class GrammarStates:
    """Matchers by scheduler sequence id; touched only by the engine between steps."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._matchers: dict[str, xgr.GrammarMatcher] = {}

    def __len__(self) -> int:
        return len(self._matchers)

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._matchers

    def add(self, seq_id: str, grammar: xgr.CompiledGrammar) -> None:
        self._matchers[seq_id] = xgr.GrammarMatcher(grammar)

    def remove(self, seq_id: str) -> None:
        self._matchers.pop(seq_id, None)

    def masks(self, batch: Batch, seq_ids: list[str]) -> TokenMasks | None:
        """Masks for ``batch``'s constrained sampled rows; ``seq_ids`` align with ``batch.sample_indices``."""
        drafts = batch.draft_token_ids
        plan: list[tuple[xgr.GrammarMatcher, int, list[int]]] = []  # matcher, first row, drafts
        row = num_rows = 0
        for j, sid in enumerate(seq_ids):
            draft = drafts[j] if drafts is not None else []
            matcher = self._matchers.get(sid)
            if matcher is not None:
                plan.append((matcher, row, draft))
                num_rows += 1 + len(draft)
            row += 1 + len(draft)
        if not plan:
            return None
        bitmask = xgr.allocate_token_bitmask(num_rows, self.vocab_size)
        rows: list[int] = []
        for matcher, first, draft in plan:
            matcher.fill_next_token_bitmask(bitmask, len(rows))
            rows.append(first)
            fed = 0
            for r, token in enumerate(draft, 1):
                if not matcher.accept_token(token):
                    break
                fed += 1
                if matcher.is_terminated():
                    break
                matcher.fill_next_token_bitmask(bitmask, len(rows))
                rows.append(first + r)
            if fed:
                matcher.rollback(fed)
        return TokenMasks(rows, bitmask[: len(rows)])

    def accept(self, seq_id: str, tokens: list[int]) -> bool:
        """Advance ``seq_id``'s matcher by the tokens its step kept; False if the grammar refuses one."""
        matcher = self._matchers.get(seq_id)
        if matcher is None:
            return True
        return all(matcher.accept_token(token) for token in tokens)
