"""A deterministic stand-in for the model, so the scheduler runs end to end without one.

It stores each step's token ids in the pages the batch names, exactly where a
model would write their k/v, and derives every sampled token from the tokens
it reads back through the sequence's page table. A scheduler bug that shares,
overwrites or forgets a page therefore changes the output, just as it would
with a real model.
"""

from __future__ import annotations

from collections.abc import Callable

from scheduling.batch import Batch, StepOutput


def next_token(tokens: tuple[int, ...], vocab_size: int) -> int:
    """The fake model: the next token is a fixed function of the whole sequence."""
    h = 1469598103934665603
    for t in tokens[-8:]:
        h = ((h ^ t) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return (h ^ len(tokens) ^ (sum(tokens) * 2654435761)) % vocab_size


class FakeModelRunner:
    """Executes ``Batch``es over a simulated paged cache of token ids.

    Speculative decoding: a sequence with drafts samples at each of its last
    ``1 + len(drafts)`` positions (reading the sequence back through its pages
    up to that position) and keeps the drafts that match, as the real runner
    does. With ``num_propose``, ``propose`` plays the draft model: from the new
    last token it writes m tokens into the pages (where a drafter writes its
    KV, so a page the scheduler did not reserve fails) and proposes them.
    ``propose(sequence, m)`` returns m drafts after ``sequence``; the default
    proposes the true continuation with every third token wrong. ``model``
    replaces ``next_token`` as the fake model.
    """

    def __init__(
        self, num_pages: int, page_size: int, vocab_size: int,
        propose: Callable[[tuple[int, ...], int], list[int]] | None = None,
        model: Callable[[tuple[int, ...], int], int] = next_token,
    ) -> None:
        self.page_size = page_size
        self.vocab_size = vocab_size
        # -1 marks a slot never written: reading one means a page-table bug.
        self.pages: list[list[int]] = [[-1] * page_size for _ in range(num_pages)]
        self.propose = propose if propose is not None else self._mostly_right
        self.model = model  # the next token of a sequence (``next_token`` unless a test swaps it)

    def _mostly_right(self, seq: tuple[int, ...], m: int) -> list[int]:
        out: list[int] = []
        for i in range(m):
            tok = self.model(seq, self.vocab_size)
            if i % 3 == 2:
                tok = (tok + 1) % self.vocab_size
            out.append(tok)
            seq = (*seq, tok)
        return out

    def _read(self, table: list[int], length: int, step: int) -> tuple[int, ...]:
        ps = self.page_size
        flat: list[int] = []
        for page in table[: -(-length // ps)]:
            flat.extend(self.pages[page])
        seq = tuple(flat[:length])
        if -1 in seq:
            raise AssertionError(f"step {step}: a sequence reads an unwritten slot")
        return seq

    def _write(self, table: list[int], pos: int, token: int) -> None:
        ps = self.page_size
        self.pages[table[pos // ps]][pos % ps] = token

    def execute(self, batch: Batch) -> StepOutput:
        offset = 0
        sampled = {i: j for j, i in enumerate(batch.sample_indices)}
        drafts = batch.drafts.token_ids
        token_ids: list[int] = []
        accepted: list[int] = []
        proposals: list[list[int]] = []
        for i, n in enumerate(batch.query_lens):
            table = batch.page_tables[i]
            for j in range(offset, offset + n):
                self._write(table, batch.positions[j], batch.input_ids[j])
            offset += n
            if i not in sampled:
                continue
            j = sampled[i]
            ctx = batch.context_lens[i]
            draft = drafts[j] if drafts is not None else []
            rows = [self.model(self._read(table, ctx - len(draft) + r, batch.step), self.vocab_size)
                    for r in range(len(draft) + 1)]
            a = 0
            while a < len(draft) and rows[a] == draft[a]:
                a += 1
            token_ids += rows
            accepted.append(a)
            m = batch.drafts.num_propose[j] if batch.drafts.num_propose is not None else 0
            proposal: list[int] = []
            if m:
                last, pos = rows[a], ctx - len(draft) + a
                seq = (*self._read(table, pos, batch.step), last)
                proposal = self.propose(seq, m)
                for r, tok in enumerate([last, *proposal[:-1]]):
                    self._write(table, pos + r, tok)
            proposals.append(proposal)
        return StepOutput(
            token_ids, [None] * len(token_ids),
            accepted if drafts is not None else None,
            proposals if batch.drafts.num_propose is not None else None,
        )


def reference_generate(prompt: list[int], max_tokens: int, vocab_size: int,
                       stop_token_ids: tuple[int, ...] = ()) -> list[int]:
    """What the fake model generates for one prompt with no cache at all."""
    seq = list(prompt)
    out: list[int] = []
    while len(out) < max_tokens:
        tok = next_token(tuple(seq), vocab_size)
        out.append(tok)
        seq.append(tok)
        if tok in stop_token_ids:
            break
    return out
