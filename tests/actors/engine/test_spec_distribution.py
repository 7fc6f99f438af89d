"""Sampled output with speculation follows the target distribution (the real model, temperature 1).

For a fixed prompt whose continuation may repeat it (so both drafters propose,
and their drafts are often but not always taken), the first three sampled
tokens of many unseeded requests are counted with and without speculation.
A chi-square test of homogeneity over the 3-token sequences (rare ones pooled)
must not reject at ``P_MIN``: with a correct verifier it fails once in 1,000
runs. The same test with a verifier that keeps every draft must reject, so
the test can tell a biased sampler from a correct one at this sample size.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import actors.runner.model_runner
from apps.llm import LLM
from scheduling.sampling_params import SamplingParams

NUM_SAMPLES = 500
P_MIN = 1e-3
MIN_EXPECTED = 5.0  # pool categories expected fewer times than this in either arm
# Two pages and a token (33 tokens of 16-token pages): after one request has put its two pages in the prefix
# cache, each sample computes one prompt token, not 33.
PROMPT = ("A line from a children's book about all the pets that live on our street: "
          "My favourite animals are cats, dogs and birds. My favourite animals are cats,")
CACHED_TOKENS = 32
ENGINE: dict[str, Any] = {"max_model_len": 256, "max_num_seqs": 128, "max_num_batched_tokens": 2048}
METHODS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 3},
    "self_draft": {"method": "draft", "layers": 10, "num_speculative_tokens": 2},
}
PARAMS = SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True)


def first_tokens(llm: LLM) -> Counter[tuple[int, ...]]:
    llm.generate([PROMPT], SamplingParams(max_tokens=1), use_tqdm=False)  # the prompt's pages into the cache
    outs = llm.generate([PROMPT] * NUM_SAMPLES, PARAMS, use_tqdm=False)
    assert all(o.num_cached_tokens == CACHED_TOKENS for o in outs)
    return Counter(tuple(o.outputs[0].token_ids) for o in outs)


def chi_square_p(a: Counter[tuple[int, ...]], b: Counter[tuple[int, ...]]) -> float:
    """p-value of the chi-square test that ``a`` and ``b`` come from one distribution."""
    n_a, n_b = sum(a.values()), sum(b.values())
    share_a = n_a / (n_a + n_b)
    keys = [k for k in a.keys() | b.keys() if min(share_a, 1 - share_a) * (a[k] + b[k]) >= MIN_EXPECTED]
    rows = [(a[k], b[k]) for k in keys]
    rest = (n_a - sum(r[0] for r in rows), n_b - sum(r[1] for r in rows))
    if rest[0] + rest[1] > 0:
        rows.append(rest)
    stat = 0.0
    for x, y in rows:
        total = x + y
        for observed, share in ((x, share_a), (y, 1 - share_a)):
            expected = total * share
            stat += (observed - expected) ** 2 / expected
    dof = len(rows) - 1
    assert dof >= 3, f"too few categories ({len(rows)}) for a meaningful test"
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.fixture(scope="module")
def baseline(smollm2_dir: Path) -> Counter[tuple[int, ...]]:
    return first_tokens(LLM(str(smollm2_dir), **ENGINE, seed=1))


@pytest.fixture(scope="module")
def engines(smollm2_dir: Path) -> Iterator[dict[str, LLM]]:
    # Every step drafts, whatever the batch size and acceptance: the test is about what is verified.
    always = {"min_acceptance": 0.0, "busy_min_acceptance": 0.0}
    llms = {m: LLM(str(smollm2_dir), **ENGINE, seed=2, speculative_config={**c, **always})
            for m, c in METHODS.items()}
    yield llms
    for llm in llms.values():
        llm.shutdown()


@pytest.mark.parametrize("method", list(METHODS))
def test_first_three_tokens_follow_the_target_distribution(
    baseline: Counter[tuple[int, ...]], engines: dict[str, LLM], method: str
) -> None:
    llm = engines[method]
    before = llm.engine.policy.stats.spec_num_draft_tokens, llm.engine.policy.stats.spec_num_accepted_tokens
    spec = first_tokens(llm)
    stats = llm.engine.policy.stats
    drafted = stats.spec_num_draft_tokens - before[0]
    accepted = stats.spec_num_accepted_tokens - before[1]
    # Drafts were verified, and both outcomes happened often: the test exercises acceptance and rejection.
    assert drafted >= NUM_SAMPLES // 2 and 0.1 * drafted < accepted < 0.9 * drafted
    p = chi_square_p(baseline, spec)
    print(f"{method}: {drafted} draft tokens, {accepted} accepted, p = {p:.3f}")
    assert p > P_MIN


def test_a_verifier_that_keeps_every_draft_is_caught(
    baseline: Counter[tuple[int, ...]], engines: dict[str, LLM], monkeypatch: pytest.MonkeyPatch
) -> None:
    def keep_all(token_ids: list[int], drafts: list[list[int]]) -> list[int]:
        return [len(d) for d in drafts]

    monkeypatch.setattr(actors.runner.model_runner, "count_accepted", keep_all)
    p = chi_square_p(baseline, first_tokens(engines["ngram"]))
    print(f"keep-all verifier: p = {p:.2e}")
    assert p < P_MIN
