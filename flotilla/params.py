"""Typed shapes of the structured-output and tool-calling request fields (OpenAI and vLLM).

Plain ``TypedDict`` s: the SDK sends them as they are, so a dict literal with
the same keys works everywhere one of these is asked for. They give an editor
and mypy something to check; the server validates the values.

- ``response_format`` (chat): ``{"type": "json_object"}`` for any JSON object,
  or ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``.
- ``tools`` (chat): OpenAI function tools; ``tool_choice`` picks ``"auto"``
  (the model decides), ``"required"`` (at least one call), ``"none"`` or one
  named function.
- ``/v1/responses`` takes the same in its own shapes: flat function
  ``tools`` (``ResponsesTool``), ``tool_choice`` naming a function by
  ``name``, and ``text={"format": {...}}`` (``ResponsesText``).
- ``structured_outputs`` (chat and completions): vLLM's extension, exactly
  one of ``json`` (a schema), ``regex``, ``choice``, ``grammar`` (EBNF) or
  ``json_object``.
"""

from __future__ import annotations

from typing import Any, Literal, TypedDict

JsonSchema = dict[str, Any]


class _JsonSchemaSpecBase(TypedDict):
    name: str


class JsonSchemaSpec(_JsonSchemaSpecBase, total=False):
    """``response_format.json_schema``: a named JSON schema; ``strict`` asks for exact conformance."""

    schema: JsonSchema
    strict: bool
    description: str


class _ResponseFormatBase(TypedDict):
    type: Literal["text", "json_object", "json_schema"]


class ResponseFormat(_ResponseFormatBase, total=False):
    """``response_format`` of a chat request (``json_schema`` only with type ``"json_schema"``)."""

    json_schema: JsonSchemaSpec


class _FunctionSpecBase(TypedDict):
    name: str


class FunctionSpec(_FunctionSpecBase, total=False):
    """One callable function: its name, what it does and its arguments' JSON schema."""

    description: str
    parameters: JsonSchema
    strict: bool


class Tool(TypedDict):
    """One entry of ``tools``: ``{"type": "function", "function": {...}}``."""

    type: Literal["function"]
    function: FunctionSpec


class FunctionName(TypedDict):
    name: str


class NamedToolChoice(TypedDict):
    """``tool_choice`` that forces one function: ``{"type": "function", "function": {"name": ...}}``."""

    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["auto", "required", "none"] | NamedToolChoice


class StructuredOutputs(TypedDict, total=False):
    """vLLM's ``structured_outputs`` constraint; give exactly one key."""

    json: JsonSchema | str
    regex: str
    choice: list[str]
    grammar: str
    json_object: bool


# ---------------------------------------------------------------- /v1/responses
class _ResponsesToolBase(TypedDict):
    type: Literal["function"]
    name: str


class ResponsesTool(_ResponsesToolBase, total=False):
    """One entry of ``tools`` on ``/v1/responses``: a function tool, flat (``name`` beside ``type``)."""

    description: str
    parameters: JsonSchema
    strict: bool


class ResponsesNamedToolChoice(TypedDict):
    """``tool_choice`` on ``/v1/responses`` that forces one function: ``{"type": "function", "name": ...}``."""

    type: Literal["function"]
    name: str


ResponsesToolChoice = Literal["auto", "required", "none"] | ResponsesNamedToolChoice


class _ResponsesFormatBase(TypedDict):
    type: Literal["text", "json_object", "json_schema"]


class ResponsesFormat(_ResponsesFormatBase, total=False):
    """``text.format`` on ``/v1/responses``: with type ``"json_schema"``, ``name`` and ``schema`` beside it."""

    name: str
    schema: JsonSchema
    strict: bool
    description: str


class ResponsesText(TypedDict, total=False):
    """``text`` on ``/v1/responses``."""

    format: ResponsesFormat
