"""``flotilla bench structured validity|overhead``: command lines.

    flotilla serve --model smollm2-135m --port 8000 &
    flotilla bench structured validity --base-url http://127.0.0.1:8000/v1 --temperatures 0,0.8 --samples 3 --json
    flotilla bench structured overhead --model smollm2-135m --runs 3 --json

``validity`` exits 1 when any reply does not parse or validate (``all_valid``
false), so a script can assert on it. Both take ``--schemas FILE`` (JSONL,
``schemas``) for a held-out set; the default set is
``cli/bench/data/structured_schemas.jsonl``. The modes are ``validity``
(its requests ``probes``, its result ``report``) and ``overhead``.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from cli.bench.structured.probes import ValiditySettings
from cli.bench.structured.report import format_table as validity_table
from cli.bench.structured.schemas import load_schema_set
from scheduling.errors import InvalidParameterError


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise InvalidParameterError("temperatures", f"must be comma-separated numbers, got {text!r}") from None


class StructuredBench:
    name = "structured"
    help = "structured output: reply validity, per-step overhead"

    def add_arguments(self, sp: argparse.ArgumentParser) -> None:
        modes = sp.add_subparsers(dest="mode", required=True)

        va = modes.add_parser("validity", help="JSON-schema replies and forced tool calls through the openai client")
        va.add_argument("--base-url", required=True,
                        help="the OpenAI client's base URL of a local server, e.g. http://127.0.0.1:8000/v1 "
                             "(loopback only)")
        va.add_argument("--api-key", default=None,
                        help="the server's API key (default: none; the client sends 'unused')")
        va.add_argument("--model", default=None, help="the model name to send (default: the first the server lists)")
        va.add_argument("--schemas", default=None, help="JSONL schema set: {\"name\", \"prompt\", \"schema\"} a line "
                                                        "(default: the built-in set of 12)")
        va.add_argument("--temperatures", default="0,0.8", help="comma-separated (default 0,0.8)")
        va.add_argument("--samples", type=int, default=3, help="json_schema requests per schema and temperature")
        va.add_argument("--max-tokens", type=int, default=512)
        va.add_argument("--concurrency", type=int, default=8, help="requests in flight at once")
        va.add_argument("--seed", type=int, default=0, help="request seeds are seed + sample index")
        va.add_argument("--timeout", type=float, default=300.0, help="seconds per request (no retries)")
        va.add_argument("--json", action="store_true", help="print one JSON object instead of the table")

        ov = modes.add_parser("overhead", help="per-step cost of constrained decoding at a mixed batch, offline")
        ov.add_argument("--model", default="tiny", help="model folder, .gguf file, hub id, tiny/small, or smollm2-135m")
        ov.add_argument("--schemas", default=None, help="JSONL schema set (default: the built-in set)")
        ov.add_argument("--batch-size", type=int, default=32, help="requests in the batch; every odd one constrained")
        ov.add_argument("--max-tokens", type=int, default=32, help="of every request")
        ov.add_argument("--runs", type=int, default=3, help="alternating mixed/unconstrained runs (medians reported)")
        ov.add_argument("--max-model-len", type=int, default=1024)
        ov.add_argument("--num-kv-pages", type=int, default=None)
        ov.add_argument("--kv-cache-memory-fraction", type=float, default=None)
        ov.add_argument("--dtype", default=None)
        ov.add_argument("--cpu-threads", type=int, default=None,
                        help="torch threads of the forward (default: every core)")
        ov.add_argument("--json", action="store_true", help="print one JSON object instead of the table")

    def run(self, args: argparse.Namespace) -> int:
        return _validity(args) if args.mode == "validity" else _overhead(args)


def _validity(args: argparse.Namespace) -> int:
    # Imported here for import cost (cli.bench.registry), and because openai / jsonschema are the
    # bench extra, not core dependencies: their absence is a message, not a traceback.
    try:
        from cli.bench.structured.validity import run
    except ImportError as exc:
        raise SystemExit(f"bench structured validity needs {exc.name}: pip install 'flotilla[bench]'") from None

    settings = ValiditySettings(base_url=args.base_url, model=args.model, api_key=args.api_key,
                                temperatures=_floats(args.temperatures), samples=args.samples,
                                max_tokens=args.max_tokens, concurrency=args.concurrency, seed=args.seed,
                                timeout_s=args.timeout)
    label, cases = load_schema_set(args.schemas)
    result = run(cases, settings, schema_set=label)
    print(json.dumps(result) if args.json else validity_table(result))
    return 0 if result["all_valid"] else 1


def _overhead(args: argparse.Namespace) -> int:
    from cli.bench.structured.overhead import format_table, run  # import cost (cli.bench.registry)

    engine: dict[str, Any] = {"max_model_len": args.max_model_len}
    for name in ("num_kv_pages", "kv_cache_memory_fraction", "dtype", "cpu_threads"):
        if getattr(args, name) is not None:
            engine[name] = getattr(args, name)
    label, cases = load_schema_set(args.schemas)
    result = run(args.model, cases, schema_set=label, batch_size=args.batch_size, max_tokens=args.max_tokens,
                 runs=args.runs, **engine)
    print(json.dumps(result) if args.json else format_table(result))
    return 0
