"""The Responses API and embeddings of a running server, asked by the official ``openai`` client; prints JSON.

    flotilla serve --model smollm2-135m &
    .venv/bin/python scripts/openai_surface_check.py --url http://127.0.0.1:8000

Checks (greedy, so each comparison is exact):

- ``responses.create`` plain; the same request through the client's own
  ``responses.stream`` helper (its deltas and its final response carry the
  plain text); ``text.format`` json_schema (the reply parses and validates);
  a forced function tool (its arguments validate against the tool's
  schema); a second turn through ``previous_response_id`` against the whole
  history sent as input.
- ``embeddings.create`` of 8 texts, batched and one by one, against
  transformers' ``hidden_states[-1]`` pooled the server's way (its default:
  last token, L2-normalised) in fp32: the largest absolute difference.
- A bad input (an empty string in the list) is a 400 naming ``input``; after
  everything no request runs and no KV page is held (``/metrics``).

``tests/cli/test_serve_real_model.py`` runs these against ``flotilla serve
--model smollm2-135m`` and asserts on the report; docs/responses.md has a run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import httpx2
import jsonschema
import openai
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from actors.load.presets import ensure_preset
from flotilla import parse_prometheus

CAPITAL = "What is the capital of Japan?"
FOLLOW_UP = "And of France?"
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                         "country": {"type": "string", "maxLength": 40}},
        "required": ["city", "country"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TEXTS = ["The harbour was quiet at dawn.", "Ships need fuel.", "A recipe for bread: flour, water, salt and yeast.",
         "Tokyo is the capital of Japan.", "x", "Die Katze schläft auf dem Sofa.", "1 + 1 = 2",
         "Embeddings map text to vectors so that similar meanings lie close together in space."]


def _valid(text: str, schema: dict[str, Any]) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def responses_report(client: openai.OpenAI, model: str) -> dict[str, Any]:
    """The Responses checks: texts, and whether each comparison held."""
    ask: dict[str, Any] = {"model": model, "temperature": 0, "max_output_tokens": 48}
    plain = client.responses.create(input=CAPITAL, **ask)
    with client.responses.stream(input=CAPITAL, **ask) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    shaped = client.responses.create(
        model=model, input="Name the capital of Japan and its country as JSON.", temperature=0,
        max_output_tokens=80, text={"format": {"type": "json_schema", "name": "city", "schema": CITY}})
    tool: Any = {"type": "function", "name": "get_weather", "description": "The weather in a city",
                 "parameters": WEATHER}
    called = client.responses.create(model=model, input="What is the weather in Paris?", tools=[tool],
                                     tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
                                     max_output_tokens=60)
    calls = [item for item in called.output if item.type == "function_call"]
    follow = client.responses.create(input=FOLLOW_UP, previous_response_id=plain.id, **ask)
    whole = client.responses.create(input=[{"role": "user", "content": CAPITAL},
                                           {"role": "assistant", "content": plain.output_text},
                                           {"role": "user", "content": FOLLOW_UP}], **ask)
    return {
        "plain_text": plain.output_text, "plain_status": plain.status,
        "stream_events": len(events), "stream_first_last": [events[0].type, events[-1].type],
        "stream_deltas_equal_plain": deltas == plain.output_text,
        "stream_final_equals_plain": final.output_text == plain.output_text,
        "json_schema_text": shaped.output_text, "json_schema_valid": _valid(shaped.output_text, CITY),
        "tool_calls": [[c.name, c.arguments] for c in calls],
        "tool_arguments_valid": len(calls) == 1 and calls[0].name == "get_weather"
        and _valid(calls[0].arguments, WEATHER),
        "second_turn_text": follow.output_text, "whole_history_text": whole.output_text,
        "second_turn_equals_whole_history": follow.output_text == whole.output_text,
        "second_turn_input_tokens": [follow.usage.input_tokens if follow.usage else None,
                                     whole.usage.input_tokens if whole.usage else None],
    }


def embeddings_report(client: openai.OpenAI, model: str, model_dir: Path) -> dict[str, Any]:
    """Largest absolute difference from transformers' last-token, normalised pooling (fp32)."""
    batched = [d.embedding for d in client.embeddings.create(model=model, input=TEXTS).data]
    alone = [client.embeddings.create(model=model, input=text).data[0].embedding for text in TEXTS]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    worst_batched = worst_alone = 0.0
    with torch.no_grad():
        for text, got, one in zip(TEXTS, batched, alone, strict=True):
            hidden = hf(tokenizer(text, return_tensors="pt").input_ids, output_hidden_states=True).hidden_states[-1]
            want = torch.nn.functional.normalize(hidden[0, -1], dim=0)
            worst_batched = max(worst_batched, (torch.tensor(got) - want).abs().max().item())
            worst_alone = max(worst_alone, (torch.tensor(one) - want).abs().max().item())
    return {"texts": len(TEXTS), "dimensions": len(batched[0]), "max_abs_diff_batched": worst_batched,
            "max_abs_diff_one_by_one": worst_alone}


def bad_input(url: str) -> dict[str, Any]:
    """The answer to an embeddings list holding an empty string."""
    reply = httpx2.post(f"{url}/v1/embeddings", json={"input": ["ok", ""]}, timeout=60)
    return {"status": reply.status_code, "param": reply.json().get("error", {}).get("param")}


def held(url: str) -> dict[str, float]:
    """Requests running and waiting, and the share of KV pages held, from ``/metrics``."""
    metrics = parse_prometheus(httpx2.get(f"{url}/metrics", timeout=60).text)

    def value(suffix: str) -> float:
        return sum(s.value for k, family in metrics.items() if k.endswith(suffix) for s in family)

    return {name: value(name) for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default %(default)s)")
    parser.add_argument("--model", default="smollm2-135m", help="the served model name (default %(default)s)")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="the HF folder for the embeddings oracle (default: the smollm2-135m preset's)")
    args = parser.parse_args(argv)
    client = openai.OpenAI(base_url=f"{args.url}/v1", api_key="unused", max_retries=0, timeout=300)
    model_dir = args.model_dir or ensure_preset("smollm2-135m")
    report = {"responses": responses_report(client, args.model),
              "embeddings": embeddings_report(client, args.model, model_dir),
              "bad_input": bad_input(args.url), "held_after": held(args.url)}
    json.dump(report, sys.stdout, indent=2, ensure_ascii=False)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
