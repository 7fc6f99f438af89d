"""The scheduler's side of speculative decoding, end to end over the fake runner.

The fake runner reads every token back through the page tables, so a draft's
page reserved wrongly, a rejected token counted as computed, or a page left
behind changes the output or the pool check.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduling.request import Request
from scheduling.sampling_params import SamplingParams
from scheduling.scheduler_config import SchedulerConfig
from scheduling.spec_config import SpeculativeConfig
from scheduling.spec_decode import PROBE_EVERY
from tests.scheduling.driver import VOCAB, Run, assert_pool_clean, drain, make, step
from tests.scheduling.fake_runner import next_token, reference_generate

NGRAM = SpeculativeConfig("ngram", 4, prompt_lookup_min=1, prompt_lookup_max=3, disable_by_batch_size=None)
DRAFT = SpeculativeConfig("draft", 3, layers=1, disable_by_batch_size=None)


def config(spec: SpeculativeConfig, **kw: object) -> SchedulerConfig:
    base: dict[str, object] = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, page_size=4)
    base.update(kw)
    return SchedulerConfig(speculative_config=spec, **base)  # type: ignore[arg-type]


def repetitive(rng: random.Random, length: int) -> list[int]:
    """A prompt that repeats a short motif (so prompt lookup finds drafts), with some noise."""
    motif = [rng.randrange(VOCAB) for _ in range(rng.randint(2, 6))]
    return [t if rng.random() > 0.1 else rng.randrange(VOCAB) for t in (motif * length)[:length]]


def add(run: Run, rid: str, prompt: list[int], max_tokens: int, **params: object) -> Request:
    r = Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **params))  # type: ignore[arg-type]
    run.policy.add(r)
    return r


def echo(seq: tuple[int, ...], vocab_size: int) -> int:
    """A fake model that repeats the token 4 back (mostly), so prompt lookup drafts well."""
    if len(seq) < 4 or len(seq) % 7 == 0:
        return next_token(seq, vocab_size)
    return seq[-4]


def echo_generate(prompt: list[int], max_tokens: int) -> list[int]:
    seq = list(prompt)
    for _ in range(max_tokens):
        seq.append(echo(tuple(seq), VOCAB))
    return seq[len(prompt):]


def test_ngram_drafts_keep_the_outputs_and_are_accepted() -> None:
    rng = random.Random(0)
    run = make(config(NGRAM), num_pages=64)
    run.runner.model = echo
    prompts = {f"r{i}": repetitive(rng, rng.randint(5, 30)) for i in range(6)}
    for rid, prompt in prompts.items():
        add(run, rid, prompt, 24)
    drain(run)
    for rid, prompt in prompts.items():
        assert run.finished[rid].output_token_ids == echo_generate(prompt, 24)
    stats = run.policy.stats
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    assert run.policy.stats.num_steps < 6 * 24 / 4  # several tokens a step
    assert sum(stats.spec_num_accepted_tokens_per_pos) == stats.spec_num_accepted_tokens
    assert_pool_clean(run)


def test_runner_proposals_are_verified_and_their_pages_reserved() -> None:
    rng = random.Random(1)
    run = make(config(DRAFT), num_pages=64)
    prompts = {f"r{i}": [rng.randrange(VOCAB) for _ in range(rng.randint(1, 20))] for i in range(5)}
    for rid, prompt in prompts.items():
        add(run, rid, prompt, 20)
    batches = 0
    while run.policy.has_work:
        batch = step(run)
        assert batch is not None
        batches += 1
        assert batches < 500
        for req in run.policy.running:  # rejected drafts' pages went back at once
            assert len(req.pages) == -(-req.num_tokens // 4)
            if req.output_token_ids:  # kept drafts count as computed: only the new token is left
                assert req.num_tokens - req.num_computed_tokens == 1
    for rid, prompt in prompts.items():
        assert run.finished[rid].output_token_ids == reference_generate(prompt, 20, VOCAB)
    stats = run.policy.stats
    # The fake drafter gets two of every three tokens right: some drafts are kept, some not.
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    assert stats.spec_num_accepted_tokens_per_pos[0] > stats.spec_num_accepted_tokens_per_pos[2]
    assert_pool_clean(run)


def test_a_stop_token_inside_the_kept_drafts_ends_the_request_there() -> None:
    prompt = [3, 9, 4, 1]
    truth = reference_generate(prompt, 12, VOCAB)
    stop = truth[3]
    run = make(config(DRAFT), num_pages=32)
    req = add(run, "s", prompt, 12, stop_token_ids=(stop,))
    drain(run)
    assert req.output_token_ids == reference_generate(prompt, 12, VOCAB, (stop,))
    assert req.finish_reason == "stop"
    assert_pool_clean(run)


def test_drafts_never_pass_max_tokens() -> None:
    run = make(config(DRAFT), num_pages=32)
    req = add(run, "m", [1, 2, 3], 5)
    while run.policy.has_work:
        batch = step(run)
        assert batch is not None
        if batch.drafts.token_ids is not None:
            assert len(req.output_token_ids) <= 5
    assert len(req.output_token_ids) == 5
    assert_pool_clean(run)


def test_a_large_batch_drafts_nothing() -> None:
    spec = SpeculativeConfig("ngram", 4, prompt_lookup_min=1, disable_by_batch_size=3)
    run = make(config(spec), num_pages=64)
    run.runner.model = echo
    for i, max_tokens in enumerate((4, 6, 24)):
        add(run, f"r{i}", [5, 6, 7, 8, 5, 6, 7, 8], max_tokens)
    while run.policy.has_work:
        running = len(run.policy.running)
        batch = step(run)
        assert batch is not None
        if running >= 3:
            assert batch.drafts.token_ids is None
    assert run.policy.stats.spec_num_drafts > 0  # drafting resumed as requests finished
    assert_pool_clean(run)


def test_a_request_whose_drafts_fail_cools_down() -> None:
    spec = SpeculativeConfig("draft", 2, layers=1, disable_by_batch_size=None, min_acceptance=0.5,
                             acceptance_window=2, cooldown_tokens=6)
    run = make(config(spec), num_pages=64)

    def wrong(seq: tuple[int, ...], m: int) -> list[int]:
        return [(next_token(seq, VOCAB) + 1) % VOCAB] * m

    run.runner.propose = wrong
    req = add(run, "c", [7, 8, 9], 20)
    drafted_at: list[int] = []
    while run.policy.has_work:
        n_out = len(req.output_token_ids)
        batch = step(run)
        assert batch is not None
        if batch.drafts.token_ids is not None:
            drafted_at.append(n_out)
    # Two failed drafts (after tokens 1 and 2), then none for the 6 tokens of the cooldown.
    assert drafted_at[:2] == [1, 2]
    assert drafted_at[2] >= 2 + 6
    assert req.output_token_ids == reference_generate([7, 8, 9], 20, VOCAB)
    assert_pool_clean(run)


@pytest.mark.parametrize(("busy_batch_size", "busy"), [(2, True), (3, False)])
def test_busy_steps_draft_only_while_the_engine_acceptance_clears_the_bar(busy_batch_size: int, busy: bool) -> None:
    # The fake drafter is right 2 times in 3: above the per-sequence bar, below the busy one.
    spec = SpeculativeConfig("draft", 3, layers=1, min_acceptance=0.25, busy_batch_size=busy_batch_size,
                             busy_min_acceptance=0.9)
    run = make(config(spec), num_pages=256)
    reqs = [add(run, f"r{i}", [4 + i, 5, 6], 120) for i in range(2)]
    steps = drafted = 0
    while run.policy.has_work:
        batch = step(run)
        assert batch is not None
        steps += 1
        drafted += batch.drafts.token_ids is not None
    policy = run.policy.spec
    assert policy is not None and policy.acceptance < 0.9
    if busy:  # the first steps (optimistic start), then one probe in PROBE_EVERY steps
        assert drafted <= 6 + steps // PROBE_EVERY
    else:
        assert drafted >= steps - 2
    for r in reqs:
        assert r.output_token_ids == reference_generate(r.prompt_token_ids, 120, VOCAB)
    assert_pool_clean(run)


def test_drafts_take_free_pages_only_and_never_preempt() -> None:
    # 2 pages: each request's prompt and first tokens fit, drafts do not.
    cfg = config(DRAFT, max_model_len=8, max_num_seqs=2, max_num_batched_tokens=16, page_size=4,
                 enable_prefix_caching=False)
    run = make(cfg, num_pages=2)
    a = add(run, "a", [1, 2, 3], 4)
    drain(run)
    assert a.output_token_ids == reference_generate([1, 2, 3], 4, VOCAB)
    assert a.num_preemptions == 0
    assert_pool_clean(run)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    method=st.sampled_from(["ngram", "draft"]),
    num_pages=st.integers(8, 40),
    page_size=st.sampled_from([1, 2, 4]),
    budget=st.integers(8, 40),
    prefix_caching=st.booleans(),
    abort_every=st.sampled_from([0, 5, 11]),
)
def test_any_mix_keeps_outputs_and_frees_every_page(
    seed: int, method: str, num_pages: int, page_size: int, budget: int, prefix_caching: bool, abort_every: int
) -> None:
    """Preemption, prefix reuse, chunked prefill and aborts with drafts: outputs exact, pool clean."""
    rng = random.Random(seed)
    spec = NGRAM if method == "ngram" else DRAFT
    max_len = min(num_pages * page_size, 48)
    cfg = SchedulerConfig(max_model_len=max_len, max_num_seqs=4, max_num_batched_tokens=max(budget, 4),
                          page_size=page_size, enable_prefix_caching=prefix_caching, speculative_config=spec)
    run = make(cfg, num_pages=num_pages)
    expected: dict[str, list[int]] = {}
    for i in range(6):
        prompt = repetitive(rng, rng.randint(1, max_len // 2))
        max_tokens = rng.randint(1, max_len - len(prompt))
        add(run, f"r{i}", prompt, max_tokens)
        expected[f"r{i}"] = reference_generate(prompt, max_tokens, VOCAB)
    aborted: set[str] = set()
    for i in range(2000):
        if not run.policy.has_work:
            break
        if abort_every and i % abort_every == abort_every - 1 and run.policy.running:
            victim = rng.choice(run.policy.running).request_id
            run.policy.abort(victim)
            aborted.add(victim)
        step(run)
    assert not run.policy.has_work
    for rid, want in expected.items():
        if rid not in aborted:
            assert run.finished[rid].output_token_ids == want
    assert_pool_clean(run)


def test_drafts_reserve_pages_after_every_request_and_never_preempt_another() -> None:
    # Two running requests and one free page at the step where both need one more: the first would
    # take it for its drafts and the second (needing it for its ordinary token) would be preempted,
    # had drafts been reserved in the same pass. Without speculation nothing is preempted here.
    for spec in (None, DRAFT):
        cfg = SchedulerConfig(max_model_len=6, max_num_seqs=2, max_num_batched_tokens=32, page_size=2,
                              enable_prefix_caching=False, speculative_config=spec)
        run = make(cfg, num_pages=3)
        a = add(run, "a", [39], 3)
        b = add(run, "b", [5, 96], 2)
        drain(run)
        assert a.num_preemptions == b.num_preemptions == 0, spec
        assert run.policy.stats.num_preemptions == 0
        assert a.output_token_ids == reference_generate([39], 3, VOCAB)
        assert b.output_token_ids == reference_generate([5, 96], 2, VOCAB)
        assert_pool_clean(run)


def test_proposals_not_taken_by_the_next_step_are_never_verified() -> None:
    # A step that does not draft (the engine's acceptance below its bar) still adds a token: the
    # proposals made before it follow an older output and must not be verified after it.
    run = make(config(DRAFT), num_pages=64)
    req = add(run, "p", [2, 7, 1], 30)
    while req.drafts is None or not req.drafts.draft_token_ids:
        assert step(run) is not None
    policy = run.policy.spec
    assert policy is not None
    drafting = policy.start_step
    policy.start_step = lambda num_running: False  # type: ignore[method-assign]
    batch = step(run)
    assert batch is not None and batch.drafts.token_ids is None
    policy.start_step = drafting  # type: ignore[method-assign]
    drafted = run.policy.stats.spec_num_draft_tokens
    batch = step(run)
    assert batch is not None and batch.drafts.token_ids is None  # stale: dropped, not verified
    assert run.policy.stats.spec_num_draft_tokens == drafted
    drain(run)
    assert req.output_token_ids == reference_generate([2, 7, 1], 30, VOCAB)
    assert run.policy.stats.spec_num_draft_tokens > drafted  # fresh proposals are verified again
    assert_pool_clean(run)


def test_a_request_cooling_down_drops_its_proposals() -> None:
    policy = make(config(DRAFT), num_pages=64).policy.spec
    assert policy is not None
    req = Request("c", [1, 2, 3], SamplingParams(max_tokens=20))
    req.output_token_ids.append(4)
    policy.set_proposals(req, [5, 6, 7])
    assert policy.drafts(req, 0) == []  # cooling down: none wanted now, and none kept for later
    assert policy.drafts(req, 3) == []
    policy.set_proposals(req, [5, 6, 7])
    assert policy.drafts(req, 2) == [5, 6]
