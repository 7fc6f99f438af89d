"""The offline API on the embedded tiny model: sampling features end to end."""

from __future__ import annotations

import pytest

from apps.llm import LLM
from scheduling.errors import InvalidParameterError
from scheduling.sampling_params import SamplingParams


def _pool_clean(llm: LLM) -> None:
    sched = llm.engine.policy
    cached = sched.cache.num_cached_pages if sched.cache is not None else 0
    assert sched.allocator.num_free_pages + cached == sched.allocator.num_pages
    assert sched.cache is None or sched.cache.num_locked_pages == 0


def test_seeded_sampling_ignores_batch_composition(tiny_llm: LLM) -> None:
    params = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=42)
    alone = tiny_llm.generate("Once upon a time", params, use_tqdm=False)[0].outputs[0].token_ids
    others = [f"other prompt {i}" * (i + 1) for i in range(7)]
    mixed_params = [SamplingParams(max_tokens=30, temperature=0.8, seed=i) for i in range(3)]
    mixed_params += [SamplingParams(max_tokens=10, temperature=0.0)] * 2
    mixed_params += [SamplingParams(max_tokens=20, temperature=1.2)] * 2
    outs = tiny_llm.generate(others[:3] + ["Once upon a time"] + others[3:], mixed_params[:3] + [params] + mixed_params[3:], use_tqdm=False)
    assert outs[3].outputs[0].token_ids == alone
    other_seed = tiny_llm.generate("Once upon a time", SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=43), use_tqdm=False)
    assert other_seed[0].outputs[0].token_ids != alone
    _pool_clean(tiny_llm)


def test_stop_string_cuts_text_before_it(tiny_llm: LLM) -> None:
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    full = tiny_llm.generate("abc", greedy, use_tqdm=False)[0].outputs[0]
    text = full.text
    printable = [i for i in range(5, len(text) - 2) if text[i].isprintable() and text[i] != "\ufffd"]
    assert printable, f"greedy text has nothing to stop on: {text!r}"
    cut = printable[len(printable) // 2]
    stop = text[cut : cut + 2]
    first = text.find(stop)
    out = tiny_llm.generate("abc", SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.text == text[:first]
    assert stop not in out.text
    _pool_clean(tiny_llm)


def test_n_sequences_share_prompt_and_follow_their_seeds(tiny_llm: LLM) -> None:
    prompt = "The same prompt for every sibling, long enough to span pages. " * 2
    out = tiny_llm.generate(prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=7, n=4), use_tqdm=False)[0]
    assert len(out.outputs) == 4
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    for i, o in enumerate(out.outputs):
        alone = tiny_llm.generate(prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=7 + i), use_tqdm=False)[0]
        assert o.token_ids == alone.outputs[0].token_ids
        assert o.finish_reason in ("length", "stop")
    _pool_clean(tiny_llm)


def test_repetition_penalty_steers_away_from_prompt_tokens(tiny_llm: LLM) -> None:
    prompt = list(range(3, 256))  # every byte token but three
    base = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    plain = tiny_llm.generate([prompt], base, use_tqdm=False)[0].outputs[0].token_ids
    assert any(t in prompt for t in plain), "precondition: plain greedy reuses prompt tokens"
    pen = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, repetition_penalty=10.0)
    got = tiny_llm.generate([prompt], pen, use_tqdm=False)[0].outputs[0].token_ids
    assert not any(t in prompt for t in got)
    _pool_clean(tiny_llm)


@pytest.mark.parametrize("kw", [{"frequency_penalty": 2.0}, {"presence_penalty": 2.0}])
def test_output_penalties_reduce_repeats(tiny_llm: LLM, kw: dict[str, float]) -> None:
    def repeats(ids: list[int]) -> int:
        return len(ids) - len(set(ids))

    prompts = [f"prompt {i}" for i in range(4)]
    base = SamplingParams(max_tokens=60, temperature=1.5, top_k=8, seed=3, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in tiny_llm.generate(prompts, base, use_tqdm=False)]
    assert sum(map(repeats, plain)) > 0, "precondition: top-8 sampling repeats tokens"
    pen = SamplingParams(max_tokens=60, temperature=1.5, top_k=8, seed=3, ignore_eos=True, **kw)  # type: ignore[arg-type]
    got = [o.outputs[0].token_ids for o in tiny_llm.generate(prompts, pen, use_tqdm=False)]
    assert got != plain
    assert sum(map(repeats, got)) < sum(map(repeats, plain))
    _pool_clean(tiny_llm)


def test_chat_uses_the_template(tiny_llm: LLM) -> None:
    out = tiny_llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=5, temperature=0.0), use_tqdm=False)[0]
    rendered = tiny_llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert "hi" in rendered
    assert out.prompt_token_ids == tiny_llm.tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert 1 <= len(out.outputs[0].token_ids) <= 5


def test_bad_prompts_are_refused_with_param(tiny_llm: LLM) -> None:
    with pytest.raises(InvalidParameterError) as e:
        tiny_llm.generate([[1, 2, 100_000]], use_tqdm=False)
    assert e.value.param == "prompt" and "100000" in str(e.value)
    with pytest.raises(InvalidParameterError) as e:
        tiny_llm.generate("x" * 600, SamplingParams(max_tokens=4), use_tqdm=False)
    assert e.value.param == "prompt"
    with pytest.raises(InvalidParameterError) as e:
        tiny_llm.generate("hello", SamplingParams(max_tokens=510), use_tqdm=False)
    assert e.value.param == "max_tokens"
    _pool_clean(tiny_llm)
    assert not tiny_llm.engine.has_unfinished
