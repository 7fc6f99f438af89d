"""Grammar pieces without an engine: the compiler's errors, cache and time bound; masks; draft look-ahead."""

from __future__ import annotations

import asyncio
import json
import threading

import jsonschema
import pytest
import torch
import xgrammar as xgr

from actors.grammar.compiler import GrammarCompiler, json_schema_grammar
from actors.grammar.masks import apply_token_masks
from actors.grammar.states import GrammarStates
from actors.load.embedded import build_tokenizer
from scheduling.batch import Batch, BatchDrafts, TokenMasks
from scheduling.errors import InvalidParameterError
from scheduling.sampling_params import SamplingParams
from scheduling.structured_output import StructuredOutput

TOKENIZER = build_tokenizer()
VOCAB = len(TOKENIZER)  # byte-level: byte b is token b
EOS = TOKENIZER.eos_token_id


def ids(text: str) -> list[int]:
    return list(text.encode())


@pytest.fixture
def compiler() -> GrammarCompiler:
    c = GrammarCompiler(TOKENIZER, VOCAB, EOS)
    yield c
    c.shutdown()


def test_token_masks_match_xgrammars_own_kernel() -> None:
    torch.manual_seed(0)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, (VOCAB + 31) // 32), dtype=torch.int32)
    logits = torch.randn(5, VOCAB)
    rows = [0, 2, 4]
    got = apply_token_masks(logits, TokenMasks(rows, bitmask))
    # Ours pairs mask i with logits row rows[i] (xgrammar's indices pick the same row of both).
    reference = logits.clone()
    for i, r in enumerate(rows):
        one = reference[r : r + 1].clone()
        xgr.apply_token_bitmask_inplace(one, bitmask[i : i + 1])
        reference[r] = one[0]
    assert torch.equal(got, reference)
    assert torch.equal(got[[1, 3]], logits[[1, 3]])  # unmasked rows untouched
    assert not torch.equal(logits, got)  # the input is not modified


def test_errors_name_the_request_field(compiler: GrammarCompiler) -> None:
    cases = [
        (StructuredOutput.regex("((", param="structured_outputs.regex"), "parenthesis"),
        (StructuredOutput.json_schema({"type": "objec"}, param="response_format"), "objec"),
        (StructuredOutput.grammar("root ::= foo", param="structured_outputs.grammar"), "foo"),
    ]
    for spec, words in cases:
        with pytest.raises(InvalidParameterError) as info:
            compiler.compile(spec)
        assert info.value.param == spec.param
        assert words in info.value.message
    # A failure is cached: the same bad spec fails at once, from the same future.
    assert compiler.submit(cases[0][0]) is compiler.submit(cases[0][0])


def test_bad_specs_are_refused_before_compiling() -> None:
    with pytest.raises(InvalidParameterError, match="not valid JSON") as info:
        StructuredOutput.json_schema("{nope", param="response_format")
    assert info.value.param == "response_format"
    with pytest.raises(InvalidParameterError):
        StructuredOutput.choice([])
    with pytest.raises(InvalidParameterError):
        StructuredOutput("xml", "<a/>")
    with pytest.raises(InvalidParameterError) as info:
        SamplingParams(ignore_eos=True, structured_output=StructuredOutput.json_object())
    assert info.value.param == "ignore_eos"


def test_a_compile_past_the_time_bound_is_refused(compiler: GrammarCompiler, monkeypatch: pytest.MonkeyPatch) -> None:
    slow = GrammarCompiler(TOKENIZER, VOCAB, EOS, timeout_s=0.05)
    # Every compile waits for the gate, so none can finish inside the bound however the threads are
    # scheduled (a bound of 1e-9 s alone lost the race to a fast compile on a busy machine).
    gate = threading.Event()
    compile_now = slow._compile

    def gated(kind: str, spec: str) -> object:
        gate.wait(30.0)
        return compile_now(kind, spec)

    monkeypatch.setattr(slow, "_compile", gated)
    spec = StructuredOutput.json_schema({"type": "object", "properties": {f"k{i}": {"type": "string"} for i in range(40)}},
                                        param="response_format")
    with pytest.raises(InvalidParameterError, match="did not compile within") as info:
        slow.compile(spec)
    assert info.value.param == "response_format"
    with pytest.raises(InvalidParameterError, match="did not compile within"):
        asyncio.run(slow.compile_async(StructuredOutput.regex("[a-z]{1,500}x")))
    gate.set()
    slow.shutdown()


def test_compiles_are_cached_and_counted(compiler: GrammarCompiler) -> None:
    spec = StructuredOutput.choice(["yes", "no"])
    first = compiler.compile(spec)
    assert compiler.compile(StructuredOutput.choice(["yes", "no"], param="other")) is first
    assert asyncio.run(compiler.compile_async(spec)) is first
    count, recent = compiler.compile_seconds()
    assert count == 1 and len(recent) == 1 and recent[0] > 0


def accepts(grammar: xgr.CompiledGrammar, text: str) -> bool:
    m = xgr.GrammarMatcher(grammar)
    return all(m.accept_token(t) for t in ids(text)) and m.accept_token(EOS)


def test_choices_are_literal(compiler: GrammarCompiler) -> None:
    choices = ['yes "quoted"', "a|b(c)*", "back\\slash", "naïve"]
    grammar = compiler.compile(StructuredOutput.choice(choices))
    assert all(accepts(grammar, c) for c in choices)
    assert not accepts(grammar, "a") and not accepts(grammar, "yes")


def test_json_strings_never_hold_raw_control_characters(compiler: GrammarCompiler) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 5}, "b": {"type": "string"}},
              "required": ["a", "b"]}
    grammar = compiler.compile(StructuredOutput.json_schema(schema))
    assert accepts(grammar, '{"a": "xy", "b": "z"}')
    assert not accepts(grammar, '{"a": "x\x02y", "b": "z"}')  # json.loads refuses these
    assert not accepts(grammar, '{"a": "xy", "b": "z\x1f"}')
    assert "\\x1f" in json_schema_grammar(json.dumps(schema))


def _batch(drafts: list[list[int]] | None, n: int) -> Batch:
    p = SamplingParams(temperature=0.0)
    return Batch(0, [0] * n, list(range(n)), [1] * n, [1] * n, [[0]] * n, list(range(n)), [p] * n,
                 [0] * n, [None] * n, [None] * n, BatchDrafts(drafts))


def test_masks_look_ahead_through_drafts_and_roll_back(compiler: GrammarCompiler) -> None:
    grammar = compiler.compile(StructuredOutput.choice(["abc", "abd"]))
    states = GrammarStates(VOCAB, compiler.closing_path)
    states.add("s0", grammar, max_tokens=64)
    # s1 is unconstrained; s0 drafts "ab" then "x" (refused: rows after it get no mask).
    masks = states.masks(_batch([ids("abx"), ids("zz")], 2), ["s0", "s1"])
    assert masks is not None and masks.rows == [0, 1, 2]  # s0's rows 0..2; row 3 (after "x") and s1 unmasked

    def allowed(i: int) -> set[int]:
        words = masks.bitmask[i].tolist()
        return {t for t in range(VOCAB) if (words[t // 32] >> (t % 32)) & 1}

    assert allowed(0) == set(ids("a")) and allowed(1) == set(ids("b")) and allowed(2) == set(ids("cd"))
    # The look-ahead was rolled back: the matcher still stands at the start.
    assert states.accept("s0", ids("abd"))
    again = states.masks(_batch(None, 1), ["s0"])
    assert again is not None and allowed_from(again, 0) == {EOS}
    assert not states.accept("s0", ids("x"))
    states.remove("s0")
    assert len(states) == 0 and states.masks(_batch(None, 1), ["s0"]) is None


def allowed_from(masks: TokenMasks, i: int) -> set[int]:
    words = masks.bitmask[i].tolist()
    return {t for t in range(VOCAB) if (words[t // 32] >> (t % 32)) & 1}


def test_strings_and_regex_dots_never_take_surrogates(compiler: GrammarCompiler) -> None:
    surrogate = b"\xed\xa9\x83"  # U+DA43 as UTF-8: not a character; decodes to three U+FFFD
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 5}, "b": {"type": "string"}},
              "required": ["a", "b"]}
    json_grammar = compiler.compile(StructuredOutput.json_schema(schema))
    regex_grammar = compiler.compile(StructuredOutput.regex("a.b[^x]"))
    for grammar, good, bad in [
        (json_grammar, '{"a": "é", "b": "𭘟"}'.encode(), b'{"a": "' + surrogate + b'", "b": ""}'),
        (json_grammar, b'{"a": "", "b": "ok"}', b'{"a": "", "b": "' + surrogate + b'"}'),
        (regex_grammar, "aébz".encode(), b"a" + surrogate + b"bz"),
        (regex_grammar, b"aab\xc3\xa9", b"aab" + surrogate),
    ]:
        assert accepts_bytes(grammar, good) and not accepts_bytes(grammar, bad)
    # Literals that look like classes keep their text.
    enum = compiler.compile(StructuredOutput.json_schema({"enum": ["[^a]", "x"]}))
    assert accepts(enum, '"[^a]"') and not accepts(enum, '"b"')


def accepts_bytes(grammar: xgr.CompiledGrammar, data: bytes) -> bool:
    m = xgr.GrammarMatcher(grammar)
    return all(m.accept_token(b) for b in data) and m.accept_token(EOS)


def test_the_closing_walk_reaches_a_complete_output_and_leaves_the_matcher(compiler: GrammarCompiler) -> None:
    schema = {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["x", "yy"]}, "minItems": 2, "maxItems": 4}},
        "required": ["name", "age", "tags"]}
    grammar = compiler.compile(StructuredOutput.json_schema(schema))
    matcher = xgr.GrammarMatcher(grammar)
    assert all(matcher.accept_token(t) for t in ids('{"name": "abc'))
    closing = compiler.closing_path()
    path = closing.walk(matcher, 200)
    assert path is not None and path[-1] == EOS
    text = '{"name": "abc' + bytes(path[:-1]).decode()  # byte-level: token b is byte b
    jsonschema.validate(json.loads(text), schema)
    assert closing.walk(matcher, len(path) - 1) is None  # not within fewer tokens
    assert matcher.accept_token(ids("d")[0])  # the walk ran on a fork: the string is still open


def test_rows_follow_the_closing_walk_when_the_budget_runs_out(compiler: GrammarCompiler) -> None:
    grammar = compiler.compile(StructuredOutput.json_schema({"type": "object", "properties": {"a": {"type": "string"}},
                                                             "required": ["a"]}))
    states = GrammarStates(VOCAB, compiler.closing_path)
    states.add("s0", grammar, max_tokens=12)  # slack 12 // 8 = 1 token
    assert states.accept("s0", ids('{"a": "xy'))  # 9 tokens out, 3 left: the walk needs 3 ('"', '}', EOS)
    batch = Batch(0, [0], [0], [1], [1], [[0]], [0], [SamplingParams(temperature=1.0)], [9], [None], [None])
    masks = states.masks(batch, ["s0"])
    assert masks is not None and allowed_from(masks, 0) == set(ids('"'))
    assert states.forced("s0")
    # With budget to spare the row is the grammar's full mask.
    states.add("s1", grammar, max_tokens=200)
    assert states.accept("s1", ids('{"a": "xy'))
    roomy = states.masks(Batch(0, [0], [0], [1], [1], [[0]], [0], [SamplingParams()], [9], [None], [None]), ["s1"])
    assert roomy is not None and len(allowed_from(roomy, 0)) > 100 and not states.forced("s1")
