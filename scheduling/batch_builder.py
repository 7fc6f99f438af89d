"""Turns the scheduler's picks for one step into a plain ``Batch``."""

from __future__ import annotations

from typing import NamedTuple

from scheduling.batch import Batch, BatchDrafts, BatchPooling
from scheduling.request import Request
from scheduling.sampling_params import SamplingParams


class Scheduled(NamedTuple):
    """One request's part of a step (a tuple: built and unpacked per request per step, on the hot path)."""

    request: Request
    num_new_tokens: int  # tokens computed this step, drafts included
    samples: bool  # the step samples a token for it
    drafts: list[int]  # draft tokens to verify: the last len() of the step's tokens
    num_propose: int  # draft tokens the runner proposes after the step


def build_batch(step: int, scheduled: list[Scheduled]) -> Batch:
    """Copy out of each request exactly what the model runner needs this step."""
    input_ids: list[int] = []
    positions: list[int] = []
    query_lens: list[int] = []
    context_lens: list[int] = []
    page_tables: list[list[int]] = []
    sample_indices: list[int] = []
    params: list[SamplingParams] = []
    num_out: list[int] = []
    prompts: list[list[int] | None] = []
    outputs: list[list[int] | None] = []
    # Per sampled sequence, only once one drafts or proposes (a step without speculation skips them).
    drafts: list[list[int]] | None = None
    propose: list[int] | None = None
    # Embedding requests whose rows this step the runner pools (``Batch.pooling.indices``), and how.
    pool_indices: list[int] = []
    pool_means: list[bool] = []
    for idx, (req, n, samples, draft, num_propose) in enumerate(scheduled):
        start = req.num_computed_tokens
        end = start + n
        pooling = req.pooling
        if pooling is not None:
            assert not samples and not draft, f"{req.request_id}: an embedding request samples nothing"
            if pooling.mode == "mean" or end == req.num_prompt_tokens:
                pool_indices.append(idx)
                pool_means.append(pooling.mode == "mean")
        if draft:  # a decode: its last sampled token, then the drafts
            input_ids.append(req.output_token_ids[-1] if req.output_token_ids else req.prompt_token_ids[-1])
            input_ids.extend(draft)
            positions.extend(range(start, end))
        elif n == 1:
            n_prompt = req.num_prompt_tokens
            input_ids.append(
                req.prompt_token_ids[start] if start < n_prompt else req.output_token_ids[start - n_prompt]
            )
            positions.append(start)
        else:
            src = req.prompt_token_ids if end <= req.num_prompt_tokens else req.all_token_ids
            input_ids.extend(src[start:end])
            positions.extend(range(start, end))
        query_lens.append(n)
        context_lens.append(end)
        page_tables.append(req.pages[:])
        if samples:
            sample_indices.append(idx)
            p = req.sampler_params
            params.append(p)
            num_out.append(len(req.output_token_ids))
            penal = p.needs_penalties
            prompts.append(req.prompt_token_ids if penal else None)
            outputs.append(req.output_token_ids[:] if penal else None)
            if drafts is None and (draft or num_propose):
                before = len(sample_indices) - 1
                drafts, propose = [[] for _ in range(before)], [0] * before
            if drafts is not None and propose is not None:
                drafts.append(draft)
                propose.append(num_propose)
    return Batch(
        step, input_ids, positions, query_lens, context_lens, page_tables,
        sample_indices, params, num_out, prompts, outputs,
        drafts=BatchDrafts(drafts if drafts is not None and any(drafts) else None,
                           propose if propose is not None and any(propose) else None),
        pooling=BatchPooling(pool_indices or None, pool_means or None),
    )
