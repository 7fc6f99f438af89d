"""``tools`` + ``tool_choice`` -> a ``ToolPlan``: which functions the prompt offers, the output constraint, the parser.

Modes (OpenAI's semantics, vLLM's mechanics):

- ``none`` (the default without tools): no tools in the prompt, plain text.
- ``auto`` (the default with tools): every tool in the prompt; the output is
  unconstrained and Hermes ``<tool_call>{"name", "arguments"}</tool_call>``
  blocks in it become tool calls (``apps.tools.scanners.HermesScanner``).
- ``required``: the output is constrained to a JSON array (at least one item)
  of ``{"name": <a tool's name>, "arguments": <its parameters>}`` objects.
- named (``{"type": "function", "function": {"name"}}``): only that tool is
  offered and the output is constrained to its ``parameters`` schema (any
  JSON object when it has none); the whole output is the call's arguments.

Every problem is an ``InvalidParameterError`` naming ``tools`` or ``tool_choice``.
"""

from __future__ import annotations

import copy
import enum
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from apps.protocol.models import ChatCompletionRequest
from apps.protocol.tools import FunctionDefinition
from apps.tools.array_scanner import ArrayScanner
from apps.tools.scanners import HermesScanner, NamedScanner, ToolScanner
from scheduling.errors import InvalidParameterError
from scheduling.structured_output import StructuredOutput

NAME_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
ANY_OBJECT: dict[str, Any] = {"type": "object"}
_DEFS_KEYS = ("$defs", "definitions")  # where "#/..." references of a tool's schema point


class ToolMode(enum.Enum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"


@dataclass(frozen=True, slots=True)
class Function:
    """One validated function tool; ``parameters`` is an object schema (``{"type": "object"}`` when absent)."""

    name: str
    description: str | None
    parameters: dict[str, Any]

    def as_tool(self) -> dict[str, Any]:
        """The OpenAI tool object (what a chat template's ``tools`` expects)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What one chat request does with tools: ``offered`` go in the prompt; ``named`` is set in NAMED mode."""

    mode: ToolMode
    offered: tuple[Function, ...] = ()
    named: str | None = None

    @property
    def active(self) -> bool:
        """Whether the prompt offers tools and the output is parsed for calls."""
        return self.mode is not ToolMode.NONE

    def constraint(self) -> StructuredOutput | None:
        """The output constraint of REQUIRED and NAMED modes (param "tools"); None otherwise."""
        if self.mode is ToolMode.NAMED:
            return StructuredOutput.json_schema(self.offered[0].parameters, param="tools")
        if self.mode is ToolMode.REQUIRED:
            return StructuredOutput.json_schema(calls_schema(self.offered), param="tools")
        return None

    def scanner(self) -> Callable[[], ToolScanner] | None:
        """A factory of per-choice output parsers, or None when the output is plain text."""
        if self.mode is ToolMode.NAMED:
            name = self.named
            assert name is not None
            return lambda: NamedScanner(name)
        if self.mode is ToolMode.REQUIRED:
            return ArrayScanner
        if self.mode is ToolMode.AUTO:
            names = frozenset(f.name for f in self.offered)
            return lambda: HermesScanner(names)
        return None


NO_TOOLS = ToolPlan(ToolMode.NONE)


def _function(i: int, fn: FunctionDefinition) -> Function:
    where = f"tools[{i}].function"
    if not NAME_PATTERN.fullmatch(fn.name):
        raise InvalidParameterError(
            "tools", f"{where}.name must be 1 to 64 of a-z, A-Z, 0-9, '_' and '-', got {fn.name!r}")
    params = ANY_OBJECT if fn.parameters is None else fn.parameters
    kind = params.get("type", "object")
    if kind != "object" and not (isinstance(kind, list) and kind == ["object"]):
        raise InvalidParameterError("tools", f"{where}.parameters must be a JSON schema of an object "
                                             f"(type \"object\"), got type {json.dumps(kind)}")
    return Function(fn.name, fn.description, params)


def tool_plan(req: ChatCompletionRequest) -> ToolPlan:
    """The request's ``ToolPlan``; raises ``InvalidParameterError`` ("tools" or "tool_choice") on bad input."""
    functions = [_function(i, tool.function) for i, tool in enumerate(req.tools or [])]
    seen: set[str] = set()
    for fn in functions:
        if fn.name in seen:
            raise InvalidParameterError("tools", f"two tools are named {fn.name!r}; names must be unique")
        seen.add(fn.name)
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if functions else "none")
    if choice == "none":
        return NO_TOOLS
    if not functions:
        shown = choice if isinstance(choice, str) else "a named function"
        raise InvalidParameterError("tool_choice", f"tool_choice {shown!r} needs a non-empty tools list")
    if choice == "auto":
        return ToolPlan(ToolMode.AUTO, tuple(functions))
    if choice == "required":
        return ToolPlan(ToolMode.REQUIRED, tuple(functions))
    assert not isinstance(choice, str), choice  # the Literal leaves only a named choice
    name = choice.function.name
    chosen = [fn for fn in functions if fn.name == name]
    if not chosen:
        raise InvalidParameterError(
            "tool_choice", f"names the function {name!r}, which is not in tools {sorted(seen)}")
    return ToolPlan(ToolMode.NAMED, (chosen[0],), name)


def calls_schema(functions: tuple[Function, ...]) -> dict[str, Any]:
    """The JSON schema of a REQUIRED answer: ``[{"name": const, "arguments": parameters}, ...]``, at least one.

    Each tool's ``$defs``/``definitions`` move to the root, where its
    ``#/$defs/...`` references now point; two tools defining one name
    differently are refused (param "tools").
    """
    defs: dict[str, dict[str, Any]] = {}
    items = []
    for fn in functions:
        params = copy.deepcopy(fn.parameters)
        for key in _DEFS_KEYS:
            found = params.pop(key, None) or {}
            if not isinstance(found, dict):
                raise InvalidParameterError("tools", f"{fn.name}: parameters.{key} must be an object")
            for def_name, body in found.items():
                merged = defs.setdefault(key, {})
                if def_name in merged and merged[def_name] != body:
                    raise InvalidParameterError(
                        "tools", f"tools define {key}/{def_name} differently; a 'required' tool_choice needs "
                                 "one definition per name")
                merged[def_name] = body
        items.append({
            "type": "object",
            "properties": {"name": {"const": fn.name}, "arguments": params},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        })
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    schema.update(defs)
    return schema
