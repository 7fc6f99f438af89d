"""Constrained generation in the engine: valid output, unchanged by scheduling, preemption and drafts; nothing leaks.

A random-weight model has no idea of JSON, so every valid reply here is the
masks' doing. The schemas are bounded (enums, integer ranges, maxLength,
maxItems) so greedy decoding ends well within ``max_tokens``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from actors.load.embedded import build_tokenizer
from apps.llm import LLM
from scheduling.sampling_params import SamplingParams
from scheduling.structured_output import StructuredOutput
from tests.actors.checkpoints import llama_config, write_checkpoint
from tests.actors.engine.test_engine_oracle import MODES, PROMPTS
from tests.actors.engine.test_spec_decode import assert_pages_free

ENGINE: dict[str, Any] = {"max_model_len": 256, "max_num_seqs": 16, "max_num_batched_tokens": 512,
                          "dtype": "float32", "device": "cpu"}
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "kind": {"enum": ["cat", "dog", "fish"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "minItems": 1, "maxItems": 3},
        "home": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "[0-9]{5}"}},
                 "required": ["zip"]},
    },
    "required": ["name", "age", "kind", "tags", "home"],
}
# The oracle's modes, with a pool that holds one max_model_len sequence but not the batch.
GRAMMAR_MODES = {**MODES, "preemption": {"num_kv_pages": 72, "page_size": 4}}
REGEX = r"[a-z]{2,6}@(example|test)\.(com|org)"
CHOICES = ["positive", "negative", "neutral"]
MAX_TOKENS = 150


def constraints() -> list[StructuredOutput]:
    return [StructuredOutput.json_schema(SCHEMA), StructuredOutput.regex(REGEX),
            StructuredOutput.choice(CHOICES), StructuredOutput.json_object()]


def params_for(i: int, temperature: float = 0.0) -> SamplingParams:
    """Every other prompt constrained (one kind after another), the rest free: a mixed batch."""
    if i % 2:
        return SamplingParams(max_tokens=24, temperature=temperature, seed=i, ignore_eos=True)
    kinds = constraints()
    spec = kinds[(i // 2) % len(kinds)]
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, seed=i, structured_output=spec)


def check_valid(text: str, spec: StructuredOutput) -> None:
    if spec.kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif spec.kind == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif spec.kind == "regex":
        assert re.fullmatch(REGEX, text), text
    else:
        assert text in CHOICES, text


def run(llm: LLM, temperature: float = 0.0) -> list[list[int]]:
    params = [params_for(i, temperature) for i in range(len(PROMPTS))]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for out, p in zip(outs, params, strict=True):
        if p.structured_output is not None:
            # "length": the output ran into max_tokens and was closed along the shortest way (still valid).
            assert out.outputs[0].finish_reason in ("stop", "length"), out.outputs[0].text
            check_valid(out.outputs[0].text, p.structured_output)
    assert len(llm.engine.grammar_states) == 0
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = write_checkpoint(tmp_path_factory.mktemp("grammar"), llama_config(), seed=0)
    build_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> list[list[int]]:
    llm = LLM(str(model_dir), **{**ENGINE, "max_num_seqs": 1, "enable_prefix_caching": False})
    out = run(llm)
    assert_pages_free(llm)
    llm.shutdown()
    return out


@pytest.mark.parametrize("mode", [m for m in GRAMMAR_MODES if m != "batch_1"])
def test_constrained_tokens_do_not_depend_on_scheduling(model_dir: Path, reference: list[list[int]], mode: str) -> None:
    llm = LLM(str(model_dir), **{**ENGINE, **GRAMMAR_MODES[mode]})
    assert run(llm) == reference
    if mode == "preemption":  # preempted sequences keep their matcher: it stands after their kept output
        assert llm.engine.policy.stats.num_preemptions > 0
    if mode == "prefix_on":
        assert run(llm) == reference
    assert_pages_free(llm)
    llm.shutdown()


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "min_acceptance": 0.0},
    {"method": "draft", "layers": 1, "num_speculative_tokens": 3, "min_acceptance": 0.0},
])
def test_drafts_are_verified_against_the_grammar(model_dir: Path, reference: list[list[int]], spec: dict[str, Any]) -> None:
    llm = LLM(str(model_dir), **ENGINE, speculative_config=spec)
    assert run(llm) == reference
    stats = llm.engine.policy.stats
    assert stats.spec_num_drafts > 0 and stats.spec_num_accepted_tokens > 0
    assert_pages_free(llm)
    llm.shutdown()


def test_sampled_constrained_outputs_are_valid_and_seeded(model_dir: Path) -> None:
    llm = LLM(str(model_dir), **ENGINE)
    first = run(llm, temperature=0.9)
    assert run(llm, temperature=0.9) == first  # seeded rows: the same tokens again
    assert_pages_free(llm)
    llm.shutdown()


def test_n_sequences_each_follow_the_constraint(model_dir: Path) -> None:
    llm = LLM(str(model_dir), **ENGINE)
    params = SamplingParams(n=4, max_tokens=MAX_TOKENS, temperature=1.0, seed=3,
                            structured_output=StructuredOutput.json_schema(SCHEMA))
    (out,) = llm.generate([PROMPTS[0]], params, use_tqdm=False)
    assert len(out.outputs) == 4
    for seq in out.outputs:
        check_valid(seq.text, StructuredOutput.json_schema(SCHEMA))
    assert len({seq.text for seq in out.outputs}) > 1
    assert_pages_free(llm)
    llm.shutdown()


def test_abort_mid_generation_frees_pages_and_matchers(model_dir: Path) -> None:
    llm = LLM(str(model_dir), **ENGINE, num_kv_pages=80, page_size=4)
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, params_for(i))
    for _ in range(4):
        engine.step()
    assert engine.has_unfinished and len(engine.grammar_states) > 0
    for i in range(len(PROMPTS)):
        engine.abort(f"r{i}")
    assert len(engine.grammar_states) == 0
    assert_pages_free(llm)
    llm.shutdown()


def test_a_constraint_that_does_not_compile_adds_nothing(model_dir: Path) -> None:
    llm = LLM(str(model_dir), **ENGINE)
    bad = SamplingParams(max_tokens=8, structured_output=StructuredOutput.regex("(("))
    with pytest.raises(Exception) as info:
        llm.engine.add_request("bad", PROMPTS[0], bad)
    assert getattr(info.value, "param", None) == "structured_outputs.regex"
    assert not llm.engine.has_unfinished and len(llm.engine.grammar_states) == 0
    assert_pages_free(llm)
    llm.shutdown()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_outputs_that_run_into_max_tokens_are_closed_complete(model_dir: Path, temperature: float) -> None:
    """Free strings and keys (json_object, an unbounded string field) let random weights write until the budget
    runs out: near it the engine follows the shortest completion, so even tight budgets give valid JSON."""
    schema = {"type": "object", "properties": {"title": {"type": "string"}, "n": {"type": "integer"},
                                               "tags": {"type": "array", "items": {"type": "string"}}},
              "required": ["title", "n", "tags"]}
    llm = LLM(str(model_dir), **ENGINE)
    specs = [StructuredOutput.json_schema(schema), StructuredOutput.json_object()]
    for max_tokens in (40, 60, 100):
        params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i, structured_output=spec)
                  for i, spec in enumerate(specs * 4)]
        outs = llm.generate(PROMPTS[: len(params)], params, use_tqdm=False)
        for out, p in zip(outs, params, strict=True):
            seq = out.outputs[0]
            value = json.loads(seq.text)
            if p.structured_output is specs[0]:
                jsonschema.validate(value, schema)
            assert isinstance(value, dict) and len(seq.token_ids) <= max_tokens
        assert any(o.outputs[0].finish_reason == "length" for o in outs)  # some were closed by the budget
    assert len(llm.engine.grammar_states) == 0
    assert_pages_free(llm)
    llm.shutdown()
