"""Prometheus text format (0.0.4) -> ``{family name: [Sample, ...]}``.

A family is named by its ``# TYPE`` line; a histogram's or summary's
``_bucket``, ``_sum`` and ``_count`` samples (and a counter's ``_total`` /
``_created``) belong to it. A sample with no declared family forms its own.
Families declared without samples map to an empty list, so a sparse server
still shows what it exports.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from flotilla.errors import FlotillaError

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_SUFFIXES = {
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("_sum", "_count", "_created"),
    "counter": ("_total", "_created"),
}
_ESCAPES = {"\\": "\\", '"': '"', "n": "\n"}


class MetricsParseError(FlotillaError, ValueError):
    """A line of the metrics text is not valid Prometheus text format."""

    def __init__(self, message: str, *, line_number: int) -> None:
        super().__init__(f"line {line_number}: {message}")
        self.line_number = line_number


@dataclass(frozen=True)
class Sample:
    """One sample: its full name (``x_bucket`` for a histogram bucket), labels and value."""

    name: str
    labels: dict[str, str] = field(default_factory=dict)
    value: float = 0.0
    timestamp_ms: int | None = None


def _labels(text: str, pos: int) -> tuple[dict[str, str], int]:
    """Parse ``{a="x",b="y"}`` starting at ``text[pos] == "{"``; return labels and the index after ``}``."""
    labels: dict[str, str] = {}
    pos += 1
    while True:
        while pos < len(text) and text[pos] in " ,":
            pos += 1
        if pos < len(text) and text[pos] == "}":
            return labels, pos + 1
        m = _NAME.match(text, pos)
        if not m:
            raise ValueError(f"expected a label name at column {pos + 1}")
        pos = m.end()
        if not text.startswith('="', pos):
            raise ValueError(f"expected =\" after label {m.group()!r}")
        pos += 2
        value: list[str] = []
        while pos < len(text) and text[pos] != '"':
            if text[pos] == "\\" and pos + 1 < len(text):
                pos += 1
                value.append(_ESCAPES.get(text[pos], "\\" + text[pos]))
            else:
                value.append(text[pos])
            pos += 1
        if pos >= len(text):
            raise ValueError(f"unterminated value of label {m.group()!r}")
        labels[m.group()] = "".join(value)
        pos += 1


def parse_sample(line: str) -> Sample:
    """One sample line: ``name{labels} value [timestamp_ms]``."""
    m = _NAME.match(line)
    if not m:
        raise ValueError("expected a metric name")
    labels: dict[str, str] = {}
    pos = m.end()
    if pos < len(line) and line[pos] == "{":
        labels, pos = _labels(line, pos)
    parts = line[pos:].split()
    if len(parts) not in (1, 2):
        raise ValueError(f"expected a value and an optional timestamp, got {line[pos:].strip()!r}")
    try:
        value = float(parts[0])
        ts = int(parts[1]) if len(parts) == 2 else None
    except ValueError:
        raise ValueError(f"not a number: {line[pos:].strip()!r}") from None
    return Sample(m.group(), labels, value, ts)


def _family(name: str, types: dict[str, str]) -> str:
    if name in types:
        return name
    for suffix in ("_bucket", "_sum", "_count", "_total", "_created"):
        base = name.removesuffix(suffix)
        if base != name and suffix in _SUFFIXES.get(types.get(base, ""), ()):
            return base
    return name


def parse_prometheus(text: str) -> dict[str, list[Sample]]:
    """Every family in ``text`` with its samples, in the order they appear."""
    types: dict[str, str] = {}
    out: dict[str, list[Sample]] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            words = line.split(None, 3)
            if len(words) >= 3 and words[1] in ("TYPE", "HELP"):
                out.setdefault(words[2], [])
                if words[1] == "TYPE" and len(words) == 4:
                    types[words[2]] = words[3].strip()
            continue
        try:
            sample = parse_sample(line)
        except ValueError as exc:
            raise MetricsParseError(str(exc), line_number=number) from None
        out.setdefault(_family(sample.name, types), []).append(sample)
    return out
