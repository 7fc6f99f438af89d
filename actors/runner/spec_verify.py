"""Verifying draft tokens: sample at every drafted position, keep the drafts the samples agree with.

A sequence with drafts ``d_1..d_k`` computes ``k + 1`` positions in one
forward; the sampler draws ``t_0..t_k`` there, row ``r`` exactly as a step
without speculation would at that output position (same params, same
per-position seed, penalties over the output as if ``d_1..d_r`` had been
generated). The kept drafts are the longest prefix with ``t_r == d_{r+1}``,
and ``t_a`` at the first disagreement (or ``t_k`` when all agree) is the new
token after them.

Why this is exact: our drafts are deterministic (prompt lookup, a greedy
draft model), so the draft distribution ``q`` is one-hot at ``d``. Rejection
sampling then accepts ``d`` with probability ``min(1, p(d) / q(d)) = p(d)``
and, on rejection, draws from the residual ``(p - q)+`` normalised, which is
``p`` without ``d``. Drawing ``t ~ p`` and keeping ``d`` iff ``t == d`` (else
emitting ``t``) has exactly that law, so every emitted token follows the
target distribution; greedy rows reduce to "keep while the draft is the
argmax", token for token the output without speculation. And since each row
draws as the unspeculated step would, a seeded request gives the same tokens
with or without speculation.
"""

from __future__ import annotations

from scheduling.batch import Batch
from scheduling.sampling_params import SamplingParams


def sample_rows(batch: Batch) -> list[int]:
    """Step token index of every row to sample: each sampled sequence's last ``1 + len(drafts)`` tokens."""
    ends: list[int] = []
    total = 0
    for n in batch.query_lens:
        total += n
        ends.append(total - 1)
    drafts = batch.drafts.token_ids
    if drafts is None:
        return [ends[i] for i in batch.sample_indices]
    rows: list[int] = []
    for j, i in enumerate(batch.sample_indices):
        k = len(drafts[j])
        rows.extend(range(ends[i] - k, ends[i] + 1))
    return rows


def expand_sampling(
    batch: Batch,
) -> tuple[list[SamplingParams], list[int], list[list[int] | None], list[list[int] | None]]:
    """The sampler's per-row lists when sequences carry drafts (``sample_rows`` order).

    Row r of a sequence samples its output token number ``num_output_tokens + r``,
    after the drafts before it: that count seeds its draw and the drafts join
    its output history for penalties.
    """
    drafts = batch.drafts.token_ids
    assert drafts is not None
    params: list[SamplingParams] = []
    num_out: list[int] = []
    prompts: list[list[int] | None] = []
    outputs: list[list[int] | None] = []
    for j, draft in enumerate(drafts):
        history = batch.output_token_ids[j]
        for r in range(len(draft) + 1):
            params.append(batch.sampling_params[j])
            num_out.append(batch.num_output_tokens[j] + r)
            prompts.append(batch.prompt_token_ids[j])
            outputs.append(None if history is None else history + draft[:r])
    return params, num_out, prompts, outputs


def count_accepted(token_ids: list[int], drafts: list[list[int]]) -> list[int]:
    """Per sequence, how many leading drafts equal the tokens sampled before them (rows as ``sample_rows``)."""
    accepted: list[int] = []
    row = 0
    for draft in drafts:
        a = 0
        while a < len(draft) and token_ids[row + a] == draft[a]:
            a += 1
        accepted.append(a)
        row += len(draft) + 1
    return accepted
