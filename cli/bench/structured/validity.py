"""``flotilla bench structured validity``: do constrained replies parse and validate, asked through openai?

Against a running OpenAI-compatible server on this machine (loopback only),
with the official ``openai`` client: for every schema of the set, at every
temperature, ``samples`` chat requests with ``response_format`` ``json_schema``
(strict; request ``seed`` is ``seed + sample``), and one forced tool call
(``tools`` = that schema as a function's parameters, ``tool_choice`` naming
it; seed ``seed``). Each json_schema reply's content, and each tool call's
arguments, go through ``json.loads`` and then ``jsonschema``: *parsed* and
*valid* count them. A tool-call reply must hold exactly one call, of the
named function. A request the server or the network fails counts as
invalid, with its error.

Requests run on ``concurrency`` threads sharing one client (no retries, a
timeout each), so the run is bounded: schemas x temperatures x (samples + 1)
requests. The result says ``all_valid``; the command exits 1 when it is
false, so a script can assert on it.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
from jsonschema.exceptions import SchemaError
from jsonschema.protocols import Validator

from cli.bench.structured.probes import KINDS, Probe, Reply, ValiditySettings, plan
from cli.bench.structured.report import failure, summarize
from cli.bench.structured.schemas import SchemaCase
from scheduling.errors import InvalidParameterError


def validators(cases: list[SchemaCase]) -> dict[str, Validator]:
    """A validator per schema name; a schema that is not valid JSON schema is an error naming it."""
    out: dict[str, Validator] = {}
    for case in cases:
        cls = jsonschema.validators.validator_for(case.schema)
        try:
            cls.check_schema(case.schema)
        except SchemaError as e:
            raise InvalidParameterError("schemas", f"{case.name}: not a valid JSON schema: {e.message}") from None
        out[case.name] = cls(case.schema)
    return out


def judge(text: str | None, validator: Validator) -> tuple[bool, str | None]:
    """``(parsed, error)`` of a reply's text: error None means it parsed and validated."""
    if text is None:
        return False, "no text in the reply"
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        return False, f"not JSON: {e.msg} at char {e.pos}"
    error = jsonschema.exceptions.best_match(validator.iter_errors(value))
    if error is not None:
        path = "/".join(str(p) for p in error.absolute_path)
        return True, f"does not validate at /{path}: {error.message}"
    return True, None


def _reply_text(probe: Probe, message: Any) -> tuple[str | None, str | None]:
    """``(text, shape error)``: the content, or the single call's arguments when it names the tool."""
    if probe.kind == "json_schema":
        return message.content, None
    calls = message.tool_calls or []
    if len(calls) != 1:
        return message.content, f"expected one tool call, got {len(calls)}"
    function = calls[0].function
    if function.name != probe.case.name:
        return function.arguments, f"called {function.name!r}, not {probe.case.name!r}"
    return function.arguments, None


def send(client: openai.OpenAI, model: str, probe: Probe, validator: Validator, settings: ValiditySettings) -> Reply:
    """Send one probe and judge its reply; a failed request is an invalid reply carrying the error."""
    start = time.perf_counter()
    try:
        resp = client.chat.completions.create(**probe.body(model, settings))
    except openai.APIError as e:
        return Reply(probe, time.perf_counter() - start, answered=False, finish_reason=None, text=None,
                     completion_tokens=None, parsed=False, valid=False, error=f"{type(e).__name__}: {e}")
    latency = time.perf_counter() - start
    choice = resp.choices[0]
    text, shape_error = _reply_text(probe, choice.message)
    parsed, error = judge(text, validator)
    tokens = resp.usage.completion_tokens if resp.usage is not None else None
    error = shape_error or error
    return Reply(probe, latency, answered=True, finish_reason=choice.finish_reason, text=text,
                 completion_tokens=tokens, parsed=parsed, valid=error is None, error=error)


def resolve_model(client: openai.OpenAI, settings: ValiditySettings) -> str:
    """``settings.model``, or the first model the server lists."""
    if settings.model is not None:
        return settings.model
    models = client.models.list().data
    if not models:
        raise InvalidParameterError("model", f"{settings.base_url}/models lists no model; give --model")
    return models[0].id


def run(cases: list[SchemaCase], settings: ValiditySettings, *, schema_set: str) -> dict[str, Any]:
    """Ask every probe of ``plan`` and judge the replies; returns the JSON-ready result."""
    checks = validators(cases)  # refuse a bad schema before sending anything
    client = openai.OpenAI(base_url=settings.base_url, api_key=settings.api_key or "unused", max_retries=0,
                           timeout=settings.timeout_s)
    try:
        model = resolve_model(client, settings)
        probes = plan(cases, settings)
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=settings.concurrency) as pool:
            replies = list(pool.map(lambda p: send(client, model, p, checks[p.case.name], settings), probes))
        seconds = time.perf_counter() - start
    finally:
        client.close()
    by_temperature = []
    for t in settings.temperatures:
        at_t = [r for r in replies if r.probe.temperature == t]
        by_temperature.append({"temperature": t, **{
            kind: summarize([r for r in at_t if r.probe.kind == kind]) for kind in KINDS}})
    num_valid = sum(r.valid for r in replies)
    return {
        "benchmark": "structured-validity",
        "base_url": settings.base_url,
        "model": model,
        "schema_set": schema_set,
        "schemas": len(cases),
        "temperatures": list(settings.temperatures),
        "samples": settings.samples,
        "max_tokens": settings.max_tokens,
        "concurrency": settings.concurrency,
        "seed": settings.seed,
        "seconds": round(seconds, 3),
        "requests": len(replies),
        "parsed": sum(r.parsed for r in replies),
        "valid": num_valid,
        "all_valid": num_valid == len(replies),
        "by_temperature": by_temperature,
        "failures": [failure(r) for r in replies if not r.valid],
    }
