"""The requests of ``flotilla bench structured validity``: its settings, what it sends, what came back.

A *probe* is one request: a schema of the set asked one way (``json_schema``
response format, or a forced ``tool_call``) at one temperature. ``plan``
lists every probe of a run; ``Reply`` is one probe's answer as judged by
``validity``.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from cli.bench.structured.schemas import SchemaCase
from scheduling.errors import InvalidParameterError

KINDS = ("json_schema", "tool_call")
LOOPBACK_NAMES = ("localhost",)


@dataclass(frozen=True, slots=True)
class ValiditySettings:
    """How the set is asked (``validity``'s docstring)."""

    base_url: str
    model: str | None = None  # None: the first model the server lists (as bench serve does)
    api_key: str | None = None  # None: the client sends "unused" (a server without keys ignores it)
    temperatures: tuple[float, ...] = (0.0, 0.8)
    samples: int = 3
    max_tokens: int = 512
    concurrency: int = 8
    seed: int = 0
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        check_loopback(self.base_url)
        if not self.temperatures or any(not 0.0 <= t <= 2.0 for t in self.temperatures):
            raise InvalidParameterError("temperatures", f"need one or more values in [0, 2], got {self.temperatures}")
        for name in ("samples", "max_tokens", "concurrency"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidParameterError(name, f"must be an integer >= 1, got {value!r}")
        if not self.timeout_s > 0:
            raise InvalidParameterError("timeout_s", f"must be > 0, got {self.timeout_s!r}")


def check_loopback(base_url: str) -> None:
    """Refuse any URL whose host is not this machine (the benchmark only talks to a local server)."""
    parts = urlsplit(base_url)
    host = parts.hostname or ""
    if parts.scheme not in ("http", "https") or not host:
        raise InvalidParameterError("base_url", f"must be an http(s) URL such as http://127.0.0.1:8000/v1, "
                                                f"got {base_url!r}")
    if host in LOOPBACK_NAMES:
        return
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise InvalidParameterError("base_url", f"must be a loopback address (127.0.0.1, ::1, localhost), got {host!r}")


@dataclass(frozen=True, slots=True)
class Probe:
    """One request: a schema asked one way at one temperature."""

    case: SchemaCase
    kind: str  # one of KINDS
    temperature: float
    sample: int

    def body(self, model: str, settings: ValiditySettings) -> dict[str, Any]:
        """Keyword arguments of ``chat.completions.create``."""
        body: dict[str, Any] = {
            "model": model, "messages": [{"role": "user", "content": self.case.prompt}],
            "temperature": self.temperature, "max_tokens": settings.max_tokens, "seed": settings.seed + self.sample,
        }
        if self.kind == "json_schema":
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": self.case.name, "schema": self.case.schema, "strict": True}}
        else:
            body["tools"] = [{"type": "function", "function": {
                "name": self.case.name, "description": self.case.prompt, "parameters": self.case.schema,
                "strict": True}}]
            body["tool_choice"] = {"type": "function", "function": {"name": self.case.name}}
        return body


@dataclass(frozen=True, slots=True)
class Reply:
    """What one probe got back, judged."""

    probe: Probe
    latency_s: float
    answered: bool  # False when the request itself failed (HTTP or network error)
    finish_reason: str | None
    text: str | None  # the content (json_schema) or the call's arguments (tool_call)
    completion_tokens: int | None
    parsed: bool
    valid: bool
    error: str | None  # why it is not valid; None when it is


def plan(cases: list[SchemaCase], settings: ValiditySettings) -> list[Probe]:
    """Every probe of the run, in sending order: per temperature, per schema, the samples then the tool call."""
    return [Probe(case, kind, t, sample)
            for t in settings.temperatures for case in cases
            for kind, sample in [*(("json_schema", s) for s in range(settings.samples)), ("tool_call", 0)]]
