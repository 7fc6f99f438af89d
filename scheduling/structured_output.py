"""What a request's output must match: a JSON schema, any JSON object, a regex, one of some strings, or a grammar.

Plain data (no xgrammar here): ``SamplingParams.structured_output`` carries
one, the engine compiles it once per distinct value (``actors.grammar``) and
masks every sampled token with it. ``param`` is the request field that asked
for it (``response_format``, ``structured_outputs.regex``, ``tools``, ...), so
a spec that does not compile is a 400 naming that field.

The value is canonical text, so equal constraints are equal objects and share
one compiled grammar: a schema is compact JSON in the caller's key order (the
order of ``properties`` is the order the output gives them in, so it is not
sorted), choices are a JSON array of strings.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from scheduling.errors import InvalidParameterError

# kind -> what ``spec`` holds
KINDS = {
    "json": "a JSON schema (JSON text)",
    "json_object": "nothing: any JSON object",
    "regex": "a regular expression the whole output matches",
    "choice": "a JSON array of strings: the output is exactly one of them",
    "grammar": "an EBNF grammar (xgrammar's dialect of GBNF) with a root rule",
}
MAX_SPEC_CHARS = 256 * 1024  # a schema or grammar larger than this is refused before compiling


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """One output constraint: ``kind`` (a key of ``KINDS``) and its canonical ``spec`` text."""

    kind: str
    spec: str = ""
    param: str = "structured_outputs"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidParameterError(self.param, f"unknown constraint {self.kind!r}; expected one of {sorted(KINDS)}")
        if not isinstance(self.spec, str):
            raise InvalidParameterError(self.param, f"must be text, got {type(self.spec).__name__}")
        if self.kind != "json_object" and not self.spec.strip():
            raise InvalidParameterError(self.param, f"the {self.kind} constraint is empty")
        if len(self.spec) > MAX_SPEC_CHARS:
            raise InvalidParameterError(
                self.param, f"the {self.kind} constraint is {len(self.spec)} characters; the limit is {MAX_SPEC_CHARS}"
            )

    @property
    def key(self) -> tuple[str, str]:
        """What compiles to the same grammar: ``param`` only names the field in errors."""
        return self.kind, self.spec

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | bool | str, *, param: str = "structured_outputs.json") -> StructuredOutput:
        """A JSON schema given as an object (or its JSON text); stored as compact JSON in its own key order."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise InvalidParameterError(param, f"the schema is not valid JSON: {exc.msg}") from None
        if not isinstance(schema, (Mapping, bool)):
            raise InvalidParameterError(param, f"a JSON schema must be an object, got {type(schema).__name__}")
        return cls("json", json.dumps(schema, ensure_ascii=False, separators=(",", ":")), param)

    @classmethod
    def json_object(cls, *, param: str = "response_format") -> StructuredOutput:
        return cls("json_object", "", param)

    @classmethod
    def regex(cls, pattern: str, *, param: str = "structured_outputs.regex") -> StructuredOutput:
        if not isinstance(pattern, str):
            raise InvalidParameterError(param, f"must be a string, got {type(pattern).__name__}")
        return cls("regex", pattern, param)

    @classmethod
    def choice(cls, choices: Sequence[str], *, param: str = "structured_outputs.choice") -> StructuredOutput:
        if isinstance(choices, str) or not isinstance(choices, Sequence):
            raise InvalidParameterError(param, "must be a list of strings")
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise InvalidParameterError(param, "must be a non-empty list of non-empty strings")
        return cls("choice", json.dumps(list(choices), ensure_ascii=False), param)

    @classmethod
    def grammar(cls, ebnf: str, *, param: str = "structured_outputs.grammar") -> StructuredOutput:
        if not isinstance(ebnf, str):
            raise InvalidParameterError(param, f"must be a string, got {type(ebnf).__name__}")
        return cls("grammar", ebnf, param)

    @property
    def choices(self) -> list[str]:
        assert self.kind == "choice", self.kind
        values: list[str] = json.loads(self.spec)
        return values
