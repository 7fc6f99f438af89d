"""Speculative decoding in the engine: the same tokens as without it, in every scheduling mode.

Seeded tiny Llamas with a byte-level tokenizer; the target has 2 layers, the
separate draft model 1 (same vocabulary, other weights, so some drafts fail).
Greedy rows must be token-for-token the unspeculated output; seeded sampled
rows too (each drafted position draws as the unspeculated step would). After
every run, abort and failure, every KV page is free again.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from apps.llm import LLM
from scheduling.errors import InvalidParameterError
from scheduling.sampling_params import SamplingParams
from tests.actors.checkpoints import (
    build_hf_model,
    build_tokenizer,
    llama_config,
    write_checkpoint,
    write_llama_with_tokenizer,
)
from tests.actors.engine.test_engine_oracle import MODES

MAX_TOKENS = 24
ENGINE: dict[str, Any] = {"max_model_len": 128, "seed": 0}
METHODS: dict[str, dict[str, Any]] = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
    "self_draft": {"method": "draft", "layers": 1, "num_speculative_tokens": 3},
    "draft_model": {"method": "draft", "num_speculative_tokens": 3},  # "model" filled in by the fixture
}


def _prompts() -> list[list[int]]:
    """Prompts with repeats (prompt lookup has something to find), sharing prefixes (the cache too)."""
    rng = random.Random(3)
    motifs = [[rng.randrange(3, 256) for _ in range(rng.randint(3, 7))] for _ in range(4)]
    shared = [rng.randrange(3, 256) for _ in range(20)]
    out = [(m * 8)[: rng.randint(12, 40)] for m in motifs]
    out += [shared + (m * 3)[:10] for m in motifs]
    out += [[rng.randrange(3, 256) for _ in range(rng.randint(2, 30))] for _ in range(4)]
    return out


PROMPTS = _prompts()


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_llama_with_tokenizer(tmp_path_factory.mktemp("spec_target"), seed=0)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A separate 1-layer checkpoint: the target's first layer, embedding and head, with its last
    layer's MLP perturbed (so it is a different model whose drafts are often, not always, right)."""
    model = build_hf_model(llama_config(), seed=0)  # the target's weights (write_llama_with_tokenizer's seed)
    model.model.layers = model.model.layers[:1]
    model.config.num_hidden_layers = 1
    with torch.no_grad():
        w = model.model.layers[0].mlp.down_proj.weight
        w.add_(0.3 * torch.randn(w.shape, generator=torch.Generator().manual_seed(9)) * w.std())
    folder = tmp_path_factory.mktemp("spec_draft")
    model.save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)
    return folder


def spec_config(method: str, draft_dir: Path) -> dict[str, Any]:
    # Speculate at every batch size and acceptance here: the tests are about what drafting does.
    cfg = {**METHODS[method], "busy_min_acceptance": 0.0}
    if method == "draft_model":
        cfg["model"] = str(draft_dir)
    return cfg


def assert_pages_free(llm: LLM) -> None:
    """Every page is free or held by the prefix cache alone, none locked."""
    engine = llm.engine
    cache = engine.policy.cache
    assert not engine.has_unfinished
    evictable = cache.num_evictable_pages if cache is not None else 0
    assert engine.allocator.num_free_pages + evictable == engine.allocator.num_pages
    assert cache is None or cache.num_locked_pages == 0
    engine.allocator.check_integrity()


def run(llm: LLM, params: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def expected(target_dir: Path) -> dict[str, list[list[int]]]:
    """The unspeculated greedy outputs of every mode."""
    return {mode: run(LLM(str(target_dir), **ENGINE, **kw), GREEDY) for mode, kw in MODES.items()}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("method", list(METHODS))
def test_greedy_tokens_are_unchanged(
    target_dir: Path, draft_dir: Path, expected: dict[str, list[list[int]]], method: str, mode: str
) -> None:
    llm = LLM(str(target_dir), **ENGINE, **MODES[mode], speculative_config=spec_config(method, draft_dir))
    assert run(llm, GREEDY) == expected[mode]
    stats = llm.engine.policy.stats
    assert stats.spec_num_drafts > 0 and stats.spec_num_accepted_tokens > 0
    assert stats.num_steps < sum(len(t) for t in expected[mode])  # several tokens in some steps
    assert_pages_free(llm)


@pytest.mark.parametrize("method", list(METHODS))
def test_seeded_sampling_with_penalties_and_logprobs_is_unchanged(
    target_dir: Path, draft_dir: Path, method: str
) -> None:
    params = [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.9, seed=11 + i, ignore_eos=True,
                       logprobs=2, repetition_penalty=1.1 if i % 2 else 1.0, presence_penalty=0.3 * (i % 3))
        for i in range(len(PROMPTS))
    ]
    base = LLM(str(target_dir), **ENGINE).generate(PROMPTS, params, use_tqdm=False)
    llm = LLM(str(target_dir), **ENGINE, speculative_config=spec_config(method, draft_dir))
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    for b, g in zip(base, got, strict=True):
        assert g.outputs[0].token_ids == b.outputs[0].token_ids
        assert g.outputs[0].text == b.outputs[0].text
        assert g.outputs[0].logprobs is not None and b.outputs[0].logprobs is not None
        for lg, lb in zip(g.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert lg.top_token_ids == lb.top_token_ids
            assert lg.logprob == pytest.approx(lb.logprob, abs=1e-4)
    assert llm.engine.policy.stats.spec_num_drafts > 0
    assert_pages_free(llm)


@pytest.mark.parametrize("method", list(METHODS))
def test_n_siblings_and_stop_strings(target_dir: Path, draft_dir: Path, method: str) -> None:
    base = LLM(str(target_dir), **ENGINE)
    prompt = PROMPTS[0]
    greedy = base.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0]
    # A stop string of printable text from the middle of the greedy reply, and a stop token later on.
    text = greedy.text
    at = next(i for i in range(len(text) // 3, len(text)) if text[i : i + 2].isascii() and text[i : i + 2].isalnum())
    params = [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, n=3, seed=5, ignore_eos=True),
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, stop=[text[at : at + 2]], ignore_eos=True),
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, stop_token_ids=[greedy.token_ids[15]],
                       ignore_eos=True),
    ]
    want = base.generate([prompt] * 3, params, use_tqdm=False)
    llm = LLM(str(target_dir), **ENGINE, speculative_config=spec_config(method, draft_dir))
    got = llm.generate([prompt] * 3, params, use_tqdm=False)
    for w, g in zip(want, got, strict=True):
        assert [(o.token_ids, o.text, o.finish_reason) for o in g.outputs] == [
            (o.token_ids, o.text, o.finish_reason) for o in w.outputs
        ]
    assert got[1].outputs[0].finish_reason == got[2].outputs[0].finish_reason == "stop"
    assert len(got[2].outputs[0].token_ids) <= 16
    assert_pages_free(llm)


@pytest.mark.parametrize("method", list(METHODS))
def test_abort_mid_generation_frees_every_page(target_dir: Path, draft_dir: Path, method: str) -> None:
    llm = LLM(str(target_dir), **ENGINE, num_kv_pages=48, page_size=4,
              speculative_config=spec_config(method, draft_dir))
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
    for _ in range(100):  # until drafts are in flight, then a few steps more
        engine.step()
        if engine.policy.stats.spec_num_drafts > 2:
            break
    assert engine.policy.stats.spec_num_drafts > 2 and engine.has_unfinished
    for i in range(len(PROMPTS)):
        engine.abort(f"r{i}")
    assert_pages_free(llm)


def test_a_self_draft_needs_fewer_layers_than_the_target(target_dir: Path) -> None:
    with pytest.raises(InvalidParameterError) as e:
        LLM(str(target_dir), **ENGINE, speculative_config={"method": "draft", "layers": 2,
                                                            "num_speculative_tokens": 2})
    assert e.value.param == "speculative_config" and "below the target's 2 layers" in str(e.value)


def test_a_draft_model_needs_the_targets_vocabulary(target_dir: Path, tmp_path: Path) -> None:
    other = write_checkpoint(tmp_path / "other", llama_config(vocab_size=300, num_hidden_layers=1), seed=1)
    build_tokenizer().save_pretrained(other)
    with pytest.raises(InvalidParameterError) as e:
        LLM(str(target_dir), **ENGINE, speculative_config={"method": "draft", "model": str(other),
                                                            "num_speculative_tokens": 2})
    assert e.value.param == "speculative_config" and "vocabulary of 300" in str(e.value)


@pytest.mark.parametrize(
    ("config", "needle"),
    [
        ('{"method": "eagle", "num_speculative_tokens": 2}', "method must be one of"),
        ('{"method": "ngram"}', "needs 'num_speculative_tokens'"),
        ('{"method": "draft", "num_speculative_tokens": 2}', "exactly one of 'model'"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
         "exceeds"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "bogus": 1}', "unknown field"),
        ("not json", "not valid JSON"),
    ],
)
def test_bad_configs_are_refused_by_name(config: str, needle: str) -> None:
    with pytest.raises(InvalidParameterError) as e:
        LLM("tiny", speculative_config=config)
    assert e.value.param == "speculative_config" and needle in str(e.value)
