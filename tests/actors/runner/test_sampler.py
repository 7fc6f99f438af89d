"""Sampler: greedy, seeded determinism, filters, penalties, logprobs, distributions."""

from __future__ import annotations

import math
import random

import pytest
import torch

import actors.runner.sampler as sampler_module
from actors.runner.logit_adjust import apply_penalties
from actors.runner.sampler import Sampler, apply_min_p, apply_top_k_top_p
from scheduling.batch import StepOutput
from scheduling.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def _sample(
    sampler: Sampler,
    logits: torch.Tensor,
    params: list[SamplingParams],
    step: int = 0,
    histories: list[tuple[list[int], list[int]] | None] | None = None,
) -> StepOutput:
    """Call ``sample`` with the lists a Batch would carry (histories only where needed)."""
    rows = len(params)
    hist = histories or [None] * rows
    prompts = [h[0] if h and p.needs_penalties else None for h, p in zip(hist, params, strict=True)]
    outputs = [h[1] if h and p.needs_penalties else None for h, p in zip(hist, params, strict=True)]
    return sampler.sample(logits, params, [step] * rows, prompts, outputs)


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# Critical chi-square values at p = 1e-4, by degrees of freedom: a correct
# sampler fails one of these checks about once in 10,000 seeds (and they are
# seeded, so never flakily).
CHI2_CRIT = {3: 21.1, 4: 23.5, 5: 25.7}


def test_greedy_is_argmax() -> None:
    assert Sampler().sample(torch.zeros(0, 8), [], [], [], []) == StepOutput([], [])
    logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(0))
    original = logits.clone()
    out = _sample(Sampler(seed=0), logits, [GREEDY] * 16)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 16
    assert torch.equal(logits, original)
    # Greedy rows next to sampled ones (the general path) are argmax too.
    params = [GREEDY, SamplingParams(temperature=1.0)] * 8
    out = _sample(Sampler(seed=0), logits, params)
    assert out.token_ids[::2] == logits.argmax(dim=-1).tolist()[::2]


def _other_rows(rng: random.Random) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=1.0, seed=rng.randrange(1000)),
        SamplingParams(temperature=0.8),
        GREEDY,
        SamplingParams(temperature=1.2, top_k=5, top_p=0.9, min_p=0.05),
        SamplingParams(temperature=1.0, frequency_penalty=0.5, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=0.7, seed=rng.randrange(1000), top_p=0.8),
    ]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, seed=1234),
        SamplingParams(temperature=0.9, seed=-7, top_k=20, top_p=0.95, min_p=0.01),
        SamplingParams(temperature=1.1, seed=42, presence_penalty=0.4, repetition_penalty=1.2),
    ],
)
def test_seeded_rows_ignore_batch_composition_and_order(params: SamplingParams) -> None:
    vocab, steps = 64, 12
    gen = torch.Generator().manual_seed(3)
    # Flat-ish logits so the draw, not the logits, decides the token.
    step_logits = [0.3 * torch.randn(vocab, generator=gen) for _ in range(steps)]
    prompt = [1, 2, 3]

    alone: list[int] = []
    sampler = Sampler(seed=0)
    for t in range(steps):
        out = _sample(sampler, step_logits[t].unsqueeze(0), [params], t, [(prompt, alone[:])])
        alone.append(out.token_ids[0])
    assert len(set(alone)) > 3  # really random, not a fixed token

    rng = random.Random(5)
    batched: list[int] = []
    sampler = Sampler(seed=99)  # a different unseeded stream must not matter
    for t in range(steps):
        others = _other_rows(rng)
        position = rng.randrange(len(others) + 1)
        row_params = others[:position] + [params] + others[position:]
        rows = [torch.randn(vocab, generator=gen) for _ in others]
        rows.insert(position, step_logits[t])
        hist: list[tuple[list[int], list[int]] | None] = [([5, 6], [7, 7]) for _ in others]
        hist.insert(position, (prompt, batched[:]))
        out = _sample(sampler, torch.stack(rows), row_params, t, hist)
        batched.append(out.token_ids[position])
    assert batched == alone


def test_different_seeds_differ_and_same_seed_repeats() -> None:
    logits = torch.zeros(1, 1000)

    def run(seed: int) -> list[int]:
        sampler = Sampler()
        params = [SamplingParams(temperature=1.0, seed=seed)]
        return [_sample(sampler, logits, params, step=t).token_ids[0] for t in range(20)]

    assert run(1) == run(1)
    assert run(1) != run(2)
    # Each step draws afresh: the position is part of the seed.
    assert len(set(run(1))) > 10


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    logits = torch.randn(32, 100, generator=torch.Generator().manual_seed(2))
    argmax = logits.argmax(dim=-1).tolist()
    for params in (SamplingParams(top_k=1), SamplingParams(top_p=1e-6, temperature=2.0)):
        assert _sample(Sampler(seed=3), logits, [params] * 32).token_ids == argmax


def _reference_mask(row: torch.Tensor, k: int, p: float) -> list[bool]:
    """Kept tokens by the textbook recipe: full sort, cut at k, cut at mass p (in float64)."""
    order = row.double().argsort(descending=True)[:k].tolist()
    if p < 1.0:
        probs = row.double()[order].softmax(dim=-1).tolist()
        mass, cut = 0.0, 0
        while mass < p:
            mass, cut = mass + probs[cut], cut + 1
        order = order[:cut]
    return [i in set(order) for i in range(row.shape[0])]


def test_top_k_top_p_match_full_sort_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    vocab, gen = 300, torch.Generator().manual_seed(8)
    cases = [(k, p) for k in (vocab, 1, 5, 100, 200) for p in (1.0, 0.05, 0.5, 0.9, 0.99)]
    # Peaked rows have small nuclei (settled by the head); flat rows have
    # nuclei of hundreds of tokens (the full-sort fallback).
    rows = [torch.randn(vocab, generator=gen) * scale for _ in cases for scale in (4.0, 0.1)]
    params = [case for case in cases for _ in (0, 1)]
    logits = torch.stack(rows)
    heads: list[int] = []
    real = sampler_module._filter_head

    def spy(x: torch.Tensor, k: torch.Tensor, p: torch.Tensor, head: int, *, whole_row_mass: bool) -> object:
        heads.append(head)
        return real(x, k, p, head, whole_row_mass=whole_row_mass)

    monkeypatch.setattr(sampler_module, "_filter_head", spy)
    top_k = [k for k, _ in params]
    top_p = [p for _, p in params]
    out = apply_top_k_top_p(logits, top_k, top_p)
    assert heads == [200, vocab]  # both paths ran
    for i, (k, p) in enumerate(params):
        kept = torch.isfinite(out[i])
        assert kept.tolist() == _reference_mask(logits[i], k, p), (i, k, p)
        assert torch.equal(out[i][kept], logits[i][kept])
        # A row's mask does not depend on its neighbours (which set the head).
        alone = apply_top_k_top_p(logits[i : i + 1], top_k[i : i + 1], top_p[i : i + 1])
        assert torch.equal(alone[0], out[i])


def test_top_k_top_p_device_branch_matches_the_cpu_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off the CPU no tensor is read: every nucleus row without top-k gets the full sort, same masks."""
    vocab, gen = 300, torch.Generator().manual_seed(9)
    params = [(k, p) for k in (vocab, 5, 200) for p in (1.0, 0.05, 0.9, 0.99) for _ in (0, 1)]
    logits = torch.stack([torch.randn(vocab, generator=gen) * (4.0 if j % 2 else 0.1) for j in range(len(params))])
    top_k, top_p = [k for k, _ in params], [p for _, p in params]
    on_cpu = apply_top_k_top_p(logits, top_k, top_p)
    monkeypatch.setattr(sampler_module, "_reads_are_free", lambda device: False)
    assert torch.equal(apply_top_k_top_p(logits, top_k, top_p), on_cpu)


def test_min_p_filters() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    kept = apply_min_p(logits, torch.tensor([0.35]))  # threshold 0.175
    assert torch.isfinite(kept).tolist() == [[True, True, False, False]]
    assert torch.equal(apply_min_p(logits, torch.tensor([0.0])), logits)

    batch = logits.expand(4000, 4)
    tokens = _sample(Sampler(seed=4), batch, [SamplingParams(min_p=0.35)] * 4000).token_ids
    assert set(tokens) == {0, 1}
    # And renormalised over the survivors: 0.5 / 0.8 = 0.625.
    assert abs(tokens.count(0) / 4000 - 0.625) < 0.03


def test_penalty_arithmetic() -> None:
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0])
    cases = {
        # Repetition: prompt (0, 1) and output tokens; positive /, negative *.
        (2.0, 0.0, 0.0): [1.0, -2.0, 0.5, 1.5, -2.0],
        # Frequency: output tokens only (1 once, 3 twice), times the count.
        (1.0, 0.5, 0.0): [2.0, -1.5, 0.5, 2.0, -2.0],
        # Presence: output tokens only, once.
        (1.0, 0.0, 0.25): [2.0, -1.25, 0.5, 2.75, -2.0],
        (2.0, 0.5, 0.25): [1.0, -2.75, 0.5, 0.25, -2.0],
    }
    params = [
        SamplingParams(repetition_penalty=r, frequency_penalty=f, presence_penalty=p)
        for r, f, p in cases
    ]
    # One row each, then all rows in one call (per-row parameters).
    for row, expected in zip(params, cases.values(), strict=True):
        assert apply_penalties(logits[None], [row], [[0, 1]], [[1, 3, 3]])[0].tolist() == expected
    rows = apply_penalties(logits.expand(4, 5), params, [[0, 1]] * 4, [[1, 3, 3]] * 4)
    assert rows.tolist() == list(cases.values())
    assert logits.tolist() == [2.0, -1.0, 0.5, 3.0, -2.0]


def test_penalties_reach_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    params = [SamplingParams(temperature=0.0, frequency_penalty=0.2)]
    assert _sample(Sampler(), logits, params, histories=[([], [])]).token_ids == [0]
    assert _sample(Sampler(), logits, params, histories=[([], [0])]).token_ids == [1]
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.1)]
    assert _sample(Sampler(), logits, params, histories=[([0], [])]).token_ids == [1]


@pytest.mark.parametrize("penalty", ["frequency_penalty", "presence_penalty"])
def test_penalty_lowers_chance_of_repeats(penalty: str) -> None:
    rows, vocab = 5000, 10
    logits = torch.zeros(rows, vocab)
    hist: list[tuple[list[int], list[int]] | None] = [([], [0, 0, 0, 1])] * rows
    plain = _sample(Sampler(seed=5), logits, [SamplingParams()] * rows, histories=hist)
    params = [SamplingParams(**{penalty: 1.0})]  # type: ignore[arg-type]
    penalised = _sample(Sampler(seed=5), logits, params * rows, histories=hist)
    plain_rate = sum(t in (0, 1) for t in plain.token_ids) / rows
    penalised_rate = sum(t in (0, 1) for t in penalised.token_ids) / rows
    assert abs(plain_rate - 0.2) < 0.03
    # Expected: frequency e^-3 + e^-1 vs 8 untouched; presence 2 e^-1 vs 8.
    expected = {"frequency_penalty": (math.exp(-3) + math.exp(-1)), "presence_penalty": 2 / math.e}
    weight = expected[penalty]
    assert abs(penalised_rate - weight / (weight + 8)) < 0.02


def test_logprobs_are_raw_log_softmax() -> None:
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(4, 30, generator=gen)
    params = [
        SamplingParams(temperature=0.7, logprobs=5, repetition_penalty=1.5),
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0, logprobs=3),
    ]
    hist: list[tuple[list[int], list[int]] | None] = [([1, 2], [3])] * 4
    original = logits.clone()
    out = _sample(Sampler(seed=0), logits, params, histories=hist)
    assert torch.equal(logits, original)  # penalties and filters work on copies
    expected = logits.log_softmax(dim=-1)
    assert out.logprobs[2] is None
    for row, n in ((0, 5), (1, 0), (3, 3)):
        lp = out.logprobs[row]
        assert lp is not None
        assert lp.token_id == out.token_ids[row]
        assert lp.logprob == pytest.approx(expected[row, lp.token_id].item(), abs=1e-5)
        values, ids = expected[row].sort(descending=True)
        assert lp.top_token_ids == ids[:n].tolist()
        assert lp.top_logprobs == pytest.approx(values[:n].tolist(), abs=1e-5)
        assert lp.top_logprobs == sorted(lp.top_logprobs, reverse=True)


def test_logit_bias_steers_only_its_rows() -> None:
    """+100 forces a token, -100 bans one, greedy or sampled; unbiased rows and logprobs are untouched."""
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(8))
    original = logits.clone()
    best = logits.argmax(dim=-1).tolist()
    second = logits.topk(2, dim=-1).indices[:, 1].tolist()
    params = [
        SamplingParams(temperature=0.0, logit_bias={5: 100.0}),
        GREEDY,
        SamplingParams(temperature=0.0, logit_bias={best[2]: -100.0}, logprobs=1),
        SamplingParams(temperature=1.0, seed=1, logit_bias={7: 100.0, 8: -3.0}),
        SamplingParams(temperature=1.0, seed=1),
    ]
    out = _sample(Sampler(seed=0), logits, params)
    assert out.token_ids[:4] == [5, best[1], second[2], 7]
    assert out.token_ids[4] == _sample(Sampler(seed=0), logits[4:], params[4:]).token_ids[0]
    assert torch.equal(logits, original)
    lp = out.logprobs[2]
    assert lp is not None  # raw: the model's distribution, before the bias
    assert lp.logprob == pytest.approx(logits[2].log_softmax(dim=-1)[second[2]].item(), abs=1e-5)
    assert lp.top_token_ids == [best[2]]


def _empirical(params: SamplingParams, logits: torch.Tensor, rows: int) -> torch.Tensor:
    batch = logits.expand(rows, -1)
    tokens = _sample(Sampler(seed=7), batch, [params] * rows).token_ids
    return torch.bincount(torch.tensor(tokens), minlength=logits.shape[-1]).float()


LOGITS = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0])


def test_temperature_distribution_matches_softmax() -> None:
    counts = _empirical(SamplingParams(temperature=0.7), LOGITS, 20000)
    assert _chi_square(counts, (LOGITS / 0.7).softmax(-1)) < CHI2_CRIT[5]
    # The check is sharp enough to notice a wrong temperature.
    assert _chi_square(counts, LOGITS.softmax(-1)) > 10 * CHI2_CRIT[5]


def test_filtered_distribution_is_renormalised() -> None:
    params = SamplingParams(temperature=1.3, top_k=4)
    counts = _empirical(params, LOGITS, 20000)
    kept = [5, 0, 1, 2]  # the four largest logits
    assert counts[[3, 4]].sum() == 0
    expected = (LOGITS[kept] / 1.3).softmax(-1)
    assert _chi_square(counts[kept], expected) < CHI2_CRIT[3]


def test_seeded_draws_follow_the_distribution() -> None:
    rows = 5000
    batch = LOGITS.expand(rows, -1)
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(rows)]
    tokens = _sample(Sampler(), batch, params, step=3).token_ids
    counts = torch.bincount(torch.tensor(tokens), minlength=6).float()
    assert _chi_square(counts, LOGITS.softmax(-1)) < CHI2_CRIT[5]
