"""Tool calls in replies: ``ToolCall`` (a whole call), ``ToolCallDelta`` (a streamed fragment).

A chat reply asks for tools in ``message.tool_calls`` (OpenAI shape:
``{"id", "type": "function", "function": {"name", "arguments"}}``, where
``arguments`` is JSON text). A stream sends each call in fragments under
``delta.tool_calls``: the first has ``index``, ``id``, ``type``, the function's
``name`` and ``arguments: ""``; later ones only ``index`` and a piece of
``arguments``. ``ToolCallAccumulator`` joins them as the openai client does
(``openai.lib.streaming._deltas.accumulate_delta``): fragments meet by
``index``; ``id``, ``function.name`` and ``function.arguments`` are set when
first seen and later pieces are appended. Only function tools exist here, so
``type`` is read from fragments but a ``ToolCall`` does not keep it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, overload

from flotilla.errors import StructuredOutputError
from flotilla.schema import M, OutputSchema, SchemaSpec


def _str_or_none(obj: Mapping[str, Any], key: str) -> str | None:
    value = obj.get(key)
    return None if value is None else str(value)


def _function(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    fn = obj.get("function")
    return fn if isinstance(fn, Mapping) else {}


@dataclass(frozen=True)
class ToolCall:
    """One function call the model asks for; ``arguments`` is the model's JSON text, as sent."""

    id: str
    name: str
    arguments: str

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> ToolCall:
        fn = _function(obj)
        return cls(str(obj.get("id") or ""), str(fn.get("name") or ""), str(fn.get("arguments") or ""))

    def to_json(self) -> dict[str, Any]:
        """The OpenAI dict, for the assistant message that goes back with the tools' results."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def load_arguments(self) -> Any:
        """``arguments`` as JSON (usually a dict); ``StructuredOutputError`` if they are not JSON."""
        try:
            return json.loads(self.arguments)
        except ValueError as exc:
            raise StructuredOutputError(f"tool call {self.name!r} ({self.id}): arguments are not JSON: {exc}",
                                        text=self.arguments, finish_reason=None) from exc

    @overload
    def parse_arguments(self, spec: type[M]) -> M: ...

    @overload
    def parse_arguments(self, spec: Mapping[str, Any]) -> Any: ...

    def parse_arguments(self, spec: SchemaSpec) -> Any:
        """``arguments`` validated against a schema; the model instance, or the JSON for a dict.

        ``spec`` is a pydantic model class, the tool's JSON schema, or the tool
        itself (``{"type": "function", "function": {"parameters": ...}}``).

        Raises ``StructuredOutputError`` when they do not match, and, for a
        dict schema, ``MissingDependencyError`` without ``jsonschema``.
        """
        if isinstance(spec, Mapping) and spec.get("type") == "function" and "function" in spec:
            spec = _function(spec).get("parameters") or {}
        schema: OutputSchema[Any] = OutputSchema.of(spec, name=self.name or None)
        return schema.validate(self.arguments, what=f"tool call {self.name!r} ({self.id}) arguments")


@dataclass(frozen=True)
class ToolCallDelta:
    """One streamed fragment of tool call ``index``; fields the fragment leaves out are ``None``."""

    index: int
    id: str | None = None
    type: str | None = None
    name: str | None = None
    arguments: str | None = None

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> ToolCallDelta:
        index = obj.get("index")
        fn = _function(obj)
        return cls(index if isinstance(index, int) else 0, _str_or_none(obj, "id"), _str_or_none(obj, "type"),
                   _str_or_none(fn, "name"), _str_or_none(fn, "arguments"))

    @classmethod
    def list_from_json(cls, fragments: Any) -> list[ToolCallDelta]:
        """The fragments of a ``delta.tool_calls`` list (anything else gives none)."""
        if not isinstance(fragments, list):
            return []
        return [cls.from_json(f) for f in fragments if isinstance(f, Mapping)]


def _join(acc: str | None, piece: str | None) -> str | None:
    if piece is None:
        return acc
    return piece if acc is None else acc + piece


@dataclass
class _Partial:
    id: str | None = None
    name: str | None = None
    arguments: str | None = None


class ToolCallAccumulator:
    """The tool calls of one streamed choice, joined from fragments (see the module docstring)."""

    def __init__(self) -> None:
        self._calls: dict[int, _Partial] = {}

    def add(self, delta: ToolCallDelta) -> None:
        acc = self._calls.setdefault(delta.index, _Partial())
        acc.id = _join(acc.id, delta.id)
        acc.name = _join(acc.name, delta.name)
        acc.arguments = _join(acc.arguments, delta.arguments)

    def calls(self) -> list[ToolCall]:
        """The calls so far, by index; ``arguments`` is whole only once the choice has finished."""
        return [ToolCall(p.id or "", p.name or "", p.arguments or "")
                for _, p in sorted(self._calls.items())]
