"""``flotilla bench structured``: the schema sets, the judging, the overhead run on tiny, and a live validity run.

The live run asks a tiny-model server (random weights) through the openai
client, so its schemas keep a valid reply short (enums, bounded integers,
short strings, few items): whatever the model says inside them is noise,
and that it parses and validates is the engine's masks at work.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from actors.grammar.compiler import json_schema_grammar
from cli.bench.structured.overhead import format_table as overhead_table
from cli.bench.structured.probes import ValiditySettings, check_loopback, plan
from cli.bench.structured.report import format_table as validity_table
from cli.bench.structured.schemas import SchemaCase, default_schema_set, read_schema_set
from cli.bench.structured.validity import judge, validators
from cli.main import main
from scheduling.errors import InvalidParameterError
from tests.serve_harness import LiveServer, shared_tiny

pytestmark = pytest.mark.ray  # on the session's shared cluster: run with the other Ray modules, last (tests/conftest.py)

SHORT = [
    {"name": "pick", "prompt": "Pick a colour and a size.", "schema": {
        "type": "object", "additionalProperties": False, "required": ["color", "size"],
        "properties": {"color": {"enum": ["red", "blue"]}, "size": {"type": "integer", "minimum": 1, "maximum": 9}}}},
    {"name": "tagged", "prompt": "Tag this.", "schema": {
        "type": "object", "additionalProperties": False, "required": ["tag", "flags"],
        "properties": {"tag": {"type": "string", "minLength": 1, "maxLength": 4},
                       "flags": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 2}}}},
]


def _cases(lines: list[dict[str, Any]]) -> list[SchemaCase]:
    return [SchemaCase(x["name"], x["prompt"], x["schema"]) for x in lines]


def _write(path: Path, lines: list[Any]) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


# -------------------------------------------------------------- schema sets
def test_the_default_set_is_varied_valid_and_compiles() -> None:
    cases = default_schema_set()
    assert len(cases) == 12 and len({c.name for c in cases}) == 12
    text = json.dumps([c.schema for c in cases])
    for feature in ("minItems", "maxItems", "enum", "minimum", "maximum", "maxLength", '"number"', '"boolean"'):
        assert feature in text, feature
    validators(cases)  # each a valid JSON schema
    for c in cases:
        json_schema_grammar(json.dumps(c.schema))  # and each compiles for the engine
        nested = [p for p in c.schema["properties"].values() if p.get("type") in ("object", "array")]
        assert c.prompt and nested, c.name  # every schema nests an object or an array


def test_reader_takes_a_held_out_set(tmp_path: Path) -> None:
    cases = read_schema_set(_write(tmp_path / "s.jsonl", [SHORT[0], "", SHORT[1]]))
    assert [(c.name, c.prompt, c.schema) for c in cases] == [(s["name"], s["prompt"], s["schema"]) for s in SHORT]


@pytest.mark.parametrize(("bad", "why"), [
    ("{oops", "Expecting"),
    ({"name": "a", "prompt": "p"}, "exactly 'name', 'prompt' and 'schema'"),
    ({"name": "has space", "prompt": "p", "schema": {"type": "object"}}, "OpenAI function name"),
    ({"name": "a", "prompt": " ", "schema": {"type": "object"}}, "prompt must be"),
    ({"name": "a", "prompt": "p", "schema": []}, "schema must be"),
    (SHORT[0], "used twice"),
])
def test_reader_refuses_a_bad_line_naming_it(tmp_path: Path, bad: Any, why: str) -> None:
    with pytest.raises(InvalidParameterError, match=rf"s\.jsonl:2: .*{why}") as e:
        read_schema_set(_write(tmp_path / "s.jsonl", [SHORT[0], bad]))
    assert e.value.param == "schemas"


def test_an_invalid_json_schema_is_refused_before_sending() -> None:
    [case] = _cases([{"name": "x", "prompt": "p", "schema": {"type": "no-such-type"}}])
    with pytest.raises(InvalidParameterError, match="x: not a valid JSON schema") as e:
        validators([case])
    assert e.value.param == "schemas"


# ------------------------------------------------------------ judging, URLs
def test_judge_separates_parsing_from_validating() -> None:
    [check] = validators(_cases(SHORT[:1])).values()
    assert judge('{"color": "red", "size": 3}', check) == (True, None)
    parsed, error = judge('{"color": "green", "size": 3}', check)
    assert parsed and error is not None and "/color" in error
    assert judge('{"color": "red", "size": 3', check)[0] is False
    assert judge(None, check) == (False, "no text in the reply")


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000/v1", "http://localhost:1/v1", "http://[::1]:8/v1",
                                 "https://127.0.0.2/v1"])
def test_loopback_urls_are_taken(url: str) -> None:
    check_loopback(url)


@pytest.mark.parametrize("url", ["http://10.0.0.1:8000/v1", "http://example.com/v1", "ftp://127.0.0.1/v1", "/v1"])
def test_other_urls_are_refused(url: str) -> None:
    with pytest.raises(InvalidParameterError) as e:
        check_loopback(url)
    assert e.value.param == "base_url"


def test_the_plan_asks_every_schema_at_every_temperature() -> None:
    cases = default_schema_set()[:3]
    probes = plan(cases, ValiditySettings("http://127.0.0.1:1/v1", temperatures=(0.0, 0.8), samples=2))
    assert len(probes) == 3 * 2 * (2 + 1)
    tool = [p for p in probes if p.kind == "tool_call"]
    assert len(tool) == 6 and {(p.case.name, p.temperature) for p in tool} == {
        (c.name, t) for c in cases for t in (0.0, 0.8)}
    body = tool[0].body("m", ValiditySettings("http://127.0.0.1:1/v1"))
    assert body["tool_choice"] == {"type": "function", "function": {"name": cases[0].name}}
    assert body["tools"][0]["function"]["parameters"] == cases[0].schema
    fmt = probes[1].body("m", ValiditySettings("http://127.0.0.1:1/v1", seed=5))
    assert fmt["response_format"]["json_schema"]["strict"] is True and fmt["seed"] == 6


@pytest.mark.parametrize(("field", "value"), [("samples", 0), ("max_tokens", 0), ("concurrency", 0),
                                              ("temperatures", ()), ("temperatures", (3.0,))])
def test_settings_refuse_bad_values(field: str, value: Any) -> None:
    with pytest.raises(InvalidParameterError) as e:
        ValiditySettings("http://127.0.0.1:1/v1", **{field: value})
    assert e.value.param == field


def test_a_remote_url_exits_2_before_any_request(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "structured", "validity", "--base-url", "http://192.0.2.1:8000/v1"]) == 2
    assert "base_url" in capsys.readouterr().err


# ----------------------------------------------------------------- overhead
def test_overhead_runs_on_tiny(tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench", "structured", "overhead", "--model", str(tiny_model_dir), "--batch-size", "4",
            "--max-tokens", "6", "--runs", "1", "--cpu-threads", "1", "--max-model-len", "512", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("model", "device", "dtype", "schema_set", "batch_size", "num_constrained", "max_tokens",
                "num_runs", "mixed_step_ms", "unconstrained_step_ms", "overhead_frac", "target_frac",
                "within_target", "grammar_ms_per_step", "grammar_frac", "engine_grammar_ms_per_step",
                "mask_apply_ms", "mask_apply_frac", "mixed_forward_ms", "unconstrained_forward_ms",
                "full_steps_mixed", "full_steps_unconstrained", "constrained_finished_early", "runs"):
        assert key in out, key
    assert (out["batch_size"], out["num_constrained"], out["num_runs"], len(out["runs"])) == (4, 2, 1, 1)
    # The first token comes from a prefill step; the later ones from decode steps, full while no request ends.
    assert out["constrained_finished_early"] == 0  # default-set replies outlast 6 tokens
    # Against the settings, not the output: the 4 prompts prefill in one step (token 1), then 5 decode steps
    # of all 4 (tokens 2..6) are the full steps the medians are taken over.
    [one] = out["runs"]
    assert one["mixed"]["steps"] == one["unconstrained"]["steps"] == 6
    assert out["full_steps_mixed"] == out["full_steps_unconstrained"] == 5
    assert out["mixed_step_ms"] > 0 and out["unconstrained_step_ms"] > 0
    # Grammar time is the constrained requests': the unconstrained run spends none.
    assert out["grammar_ms_per_step"] > 0 and one["unconstrained"]["grammar_ms"] == 0 and out["mask_apply_ms"] > 0
    assert out["overhead_frac"] == pytest.approx(
        (out["mixed_step_ms"] - out["unconstrained_step_ms"]) / out["unconstrained_step_ms"], abs=1e-3)
    assert "overhead_frac" in overhead_table(out)


# ----------------------------------------------------------------- validity
@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> LiveServer:
    """The session's tiny app (``shared_tiny``)."""
    return shared_tiny(tiny_model_dir)


def test_live_validity_through_the_cli(server: LiveServer, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    schemas = _write(tmp_path / "short.jsonl", SHORT)
    args = ["bench", "structured", "validity", "--base-url", f"{server.url}/v1", "--schemas", str(schemas),
            "--samples", "2", "--temperatures", "0,0.8", "--max-tokens", "200", "--concurrency", "4", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == "tiny" and out["schema_set"] == str(schemas) and out["schemas"] == 2
    assert (out["requests"], out["parsed"], out["valid"], out["all_valid"], out["failures"]) == (12, 12, 12, True, [])
    assert [row["temperature"] for row in out["by_temperature"]] == [0.0, 0.8]
    for row in out["by_temperature"]:
        js, tool = row["json_schema"], row["tool_call"]
        assert (js["requests"], js["valid"], js["errors"]) == (4, 4, 0) and js["finish_reasons"] == {"stop": 4}
        assert (tool["requests"], tool["valid"], tool["errors"]) == (2, 2, 0)
        assert sum(tool["finish_reasons"].values()) == 2
        assert js["latency_median_s"] > 0 and js["completion_tokens_median"] >= 1
    server.assert_pages_free()


def test_live_cut_replies_are_invalid_and_exit_1(server: LiveServer, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Three tokens cannot hold a whole reply: each is cut (finish_reason length), reported with its text."""
    schemas = _write(tmp_path / "short.jsonl", SHORT[:1])
    args = ["bench", "structured", "validity", "--base-url", f"{server.url}/v1", "--schemas", str(schemas),
            "--samples", "1", "--temperatures", "0", "--max-tokens", "3"]
    assert main(args) == 1
    table = capsys.readouterr().out
    assert "all_valid False: 0 of 2 replies valid" in table and "FAIL pick json_schema" in table
    assert main([*args, "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert {f["kind"] for f in out["failures"]} == {"json_schema", "tool_call"}
    js = next(f for f in out["failures"] if f["kind"] == "json_schema")
    assert js["finish_reason"] == "length" and js["text"].startswith("{") and "not JSON" in js["error"]
    server.assert_pages_free()
    assert "all_valid" in validity_table(out)
