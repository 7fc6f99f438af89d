"""A deterministic stand-in for the model, so the scheduler runs end to end without one.

It stores each step's token ids in the pages the batch names, exactly where a
model would write their k/v, and derives every sampled token from the tokens
it reads back through the sequence's page table. A scheduler bug that shares,
overwrites or forgets a page therefore changes the output, just as it would
with a real model.
"""

from __future__ import annotations

from scheduling.batch import Batch, StepOutput


def next_token(tokens: tuple[int, ...], vocab_size: int) -> int:
    """The fake model: the next token is a fixed function of the whole sequence."""
    h = 1469598103934665603
    for t in tokens[-8:]:
        h = ((h ^ t) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return (h ^ len(tokens) ^ (sum(tokens) * 2654435761)) % vocab_size


class FakeModelRunner:
    """Executes ``Batch``es over a simulated paged cache of token ids."""

    def __init__(self, num_pages: int, page_size: int, vocab_size: int) -> None:
        self.page_size = page_size
        self.vocab_size = vocab_size
        # -1 marks a slot never written: reading one means a page-table bug.
        self.pages: list[list[int]] = [[-1] * page_size for _ in range(num_pages)]

    def execute(self, batch: Batch) -> StepOutput:
        ps = self.page_size
        offset = 0
        sample_rows = set(batch.sample_indices)
        token_ids: list[int] = []
        for i, n in enumerate(batch.query_lens):
            table = batch.page_tables[i]
            for j in range(offset, offset + n):
                pos = batch.positions[j]
                self.pages[table[pos // ps]][pos % ps] = batch.input_ids[j]
            offset += n
            if i in sample_rows:
                ctx = batch.context_lens[i]
                flat: list[int] = []
                for page in table[: -(-ctx // ps)]:
                    flat.extend(self.pages[page])
                seq = tuple(flat[:ctx])
                if -1 in seq:
                    raise AssertionError(f"step {batch.step}: sequence {i} reads an unwritten slot")
                token_ids.append(next_token(seq, self.vocab_size))
        return StepOutput(token_ids, [None] * len(token_ids))


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
