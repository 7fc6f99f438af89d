"""The schema set of ``flotilla bench structured``: the default one, or a JSONL file of held-out schemas.

The default set is itself such a file (``data/structured_schemas.jsonl``;
``data/README.md`` says what it covers). One schema a line:

    {"name": "weather", "prompt": "Describe today's weather as JSON.", "schema": {"type": "object", ...}}

``name`` is an OpenAI function name (``[A-Za-z0-9_-]{1,64}``, unique in the
set): it names the ``json_schema`` response format and the tool of the
forced tool call. ``prompt`` is the user message sent with it. Whether
``schema`` is a valid JSON schema is judged where it is used
(``validity`` checks it with ``jsonschema``; the server compiles it).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cli.bench.workload import DATA_DIR
from scheduling.errors import InvalidParameterError

NAME_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")
DEFAULT_SET = "default"  # how a result names the built-in set
DEFAULT_SET_PATH = DATA_DIR / "structured_schemas.jsonl"


@dataclass(frozen=True, slots=True)
class SchemaCase:
    """One schema of the set, with the prompt that asks for it."""

    name: str
    prompt: str
    schema: dict[str, Any]


def default_schema_set() -> list[SchemaCase]:
    """The built-in set (``DEFAULT_SET_PATH``)."""
    return read_schema_set(DEFAULT_SET_PATH)


def _parse_line(obj: Any) -> SchemaCase:
    """One schema case; raises ValueError with the reason (the caller adds the line)."""
    if not isinstance(obj, dict) or set(obj) != {"name", "prompt", "schema"}:
        raise ValueError("a line must be an object with exactly 'name', 'prompt' and 'schema'")
    name, prompt, schema = obj["name"], obj["prompt"], obj["schema"]
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise ValueError(f"name must match {NAME_PATTERN.pattern} (an OpenAI function name), got {name!r}")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("prompt must be a non-empty string")
    if not isinstance(schema, dict) or not schema:
        raise ValueError("schema must be a non-empty JSON object")
    return SchemaCase(name, prompt, schema)


def read_schema_set(path: str | Path) -> list[SchemaCase]:
    """Parse and check a JSONL schema set; a bad line is an error naming its number (param ``schemas``)."""
    p = Path(path)
    if not p.is_file():
        raise InvalidParameterError("schemas", f"{p} is not a file")
    cases: list[SchemaCase] = []
    seen: set[str] = set()
    for lineno, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            case = _parse_line(json.loads(line))
        except ValueError as e:  # json.JSONDecodeError is a ValueError
            raise InvalidParameterError("schemas", f"{p}:{lineno}: {e}") from None
        if case.name in seen:
            raise InvalidParameterError("schemas", f"{p}:{lineno}: name {case.name!r} is used twice")
        seen.add(case.name)
        cases.append(case)
    if not cases:
        raise InvalidParameterError("schemas", f"{p} holds no schemas")
    return cases


def load_schema_set(path: str | Path | None) -> tuple[str, list[SchemaCase]]:
    """``(label, cases)``: the file's set, or the default set when ``path`` is None."""
    if path is None:
        return DEFAULT_SET, default_schema_set()
    return str(path), read_schema_set(path)
