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

Near the end of its ``max_tokens`` a sequence's rows may instead be forced
onto the shortest way to a complete output (``actors.grammar.closing``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import xgrammar as xgr

from actors.grammar.closing import MAX_CLOSING_BYTES, ClosingPath
from scheduling.batch import Batch, TokenMasks

# Tokens a sequence keeps in hand beyond its closing walk: one free token can lengthen the walk
# (say by opening an object whose required keys must then be written), so closing starts early;
# by at most an eighth of max_tokens, so a short budget still leaves the model its choices.
CLOSING_SLACK = 32
# The most a walk is assumed to change by per token (a token is rarely longer): between walks,
# a sequence skips the steps in which the walk could not have reached its budget.
WALK_CHANGE_PER_TOKEN = 16


@dataclass(slots=True)
class _Constrained:
    matcher: xgr.GrammarMatcher
    max_tokens: int
    watch_from: int  # check the closing walk every step once this many tokens (or fewer) are left
    slack: int  # start closing when the walk plus this many tokens needs all that is left
    next_walk: int  # the tokens left at which to walk next (once within ``watch_from``)
    walk_bytes: int | None = None  # the last walk's length, and the output bytes added since
    bytes_since: int = 0
    forced: bool = False  # its rows followed a closing walk


class GrammarStates:
    """Matchers by scheduler sequence id; touched only by the engine between steps.

    ``closing`` gives the vocabulary's ``ClosingPath`` (built once the first
    grammar has compiled, so it is asked for lazily).
    """

    def __init__(self, vocab_size: int, closing: Callable[[], ClosingPath]) -> None:
        self.vocab_size = vocab_size
        self._closing = closing
        self._seqs: dict[str, _Constrained] = {}

    def __len__(self) -> int:
        return len(self._seqs)

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._seqs

    def add(self, seq_id: str, grammar: xgr.CompiledGrammar, max_tokens: int) -> None:
        matcher = xgr.GrammarMatcher(grammar)
        # The walk from the start sizes the watch window: later walks are about as long.
        first = self._closing().walk(matcher, MAX_CLOSING_BYTES)
        slack = min(CLOSING_SLACK, max_tokens // 8)
        watch = 2 * (len(first) if first is not None else MAX_CLOSING_BYTES // 2) + slack
        self._seqs[seq_id] = _Constrained(matcher, max_tokens, watch, slack, watch)

    def remove(self, seq_id: str) -> None:
        self._seqs.pop(seq_id, None)

    def forced(self, seq_id: str) -> bool:
        """Whether ``seq_id`` was finished along a closing walk (its budget, not the model, ended it)."""
        seq = self._seqs.get(seq_id)
        return seq is not None and seq.forced

    def masks(self, batch: Batch, seq_ids: list[str]) -> TokenMasks | None:
        """Masks for ``batch``'s constrained sampled rows; ``seq_ids`` align with ``batch.sample_indices``."""
        drafts = batch.drafts.token_ids
        plan: list[tuple[_Constrained, int, list[int], int]] = []  # sequence, first row, drafts, tokens left
        row = num_rows = 0
        for j, sid in enumerate(seq_ids):
            draft = drafts[j] if drafts is not None else []
            seq = self._seqs.get(sid)
            if seq is not None:
                plan.append((seq, row, draft, seq.max_tokens - batch.num_output_tokens[j]))
                num_rows += 1 + len(draft)
            row += 1 + len(draft)
        if not plan:
            return None
        bitmask = xgr.allocate_token_bitmask(num_rows, self.vocab_size)
        rows: list[int] = []
        for seq, first, draft, left in plan:
            path = self._closing_path(seq, left)
            if path is not None:
                self._follow(path, draft, first, bitmask, rows)
            else:
                self._look_ahead(seq.matcher, draft, first, bitmask, rows)
        return TokenMasks(rows, bitmask[: len(rows)])

    def _closing_path(self, seq: _Constrained, left: int) -> list[int] | None:
        """The walk ``seq`` must follow now, or None while it has tokens to spare (or none fits).

        Between walks: output bytes shorten a completion by at most their
        number, so while the last walk less the bytes since is longer than
        what is left, no walk can fit; and with tokens to spare, a walk grows
        by at most ``WALK_CHANGE_PER_TOKEN`` a token, so the steps before it
        could reach the budget are skipped.
        """
        if left > seq.watch_from:
            return None
        if seq.walk_bytes is not None and (seq.walk_bytes - seq.bytes_since > left or left > seq.next_walk):
            return None
        path = self._closing().walk(seq.matcher, MAX_CLOSING_BYTES)
        length = len(path) if path is not None else 2 * MAX_CLOSING_BYTES
        seq.walk_bytes, seq.bytes_since = length, 0
        if path is not None and left - seq.slack <= length <= left:
            seq.forced = True
            return path
        seq.next_walk = left - max(1, (left - seq.slack - length) // WALK_CHANGE_PER_TOKEN)
        return None

    def _follow(self, path: list[int], draft: list[int], first: int, bitmask: torch.Tensor, rows: list[int]) -> None:
        """Force each row onto ``path`` while the drafts before it agree with the path."""
        closing = self._closing()
        for r in range(min(len(path), 1 + len(draft))):
            if r and draft[r - 1] != path[r - 1]:
                break  # the row before samples path[r - 1], so this draft is refused there
            closing.force(path[r], bitmask, len(rows))
            rows.append(first + r)

    @staticmethod
    def _look_ahead(
        matcher: xgr.GrammarMatcher, draft: list[int], first: int, bitmask: torch.Tensor, rows: list[int]
    ) -> None:
        """Fill the row of each position the drafts reach, then roll the matcher back."""
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

    def accept(self, seq_id: str, tokens: list[int]) -> bool:
        """Advance ``seq_id``'s matcher by the tokens its step kept; False if the grammar refuses one."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            return True
        if seq.walk_bytes is not None:
            sizes = self._closing().token_bytes
            seq.bytes_since += sum(sizes[t] for t in tokens)
        return all(seq.matcher.accept_token(token) for token in tokens)
