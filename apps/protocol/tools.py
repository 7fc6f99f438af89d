"""Request models of structured output and tool calling: ``response_format``, ``structured_outputs``, ``tools``.

Pydantic shapes only (the HTTP boundary); what they mean is built elsewhere:
``apps.inputs.structured`` turns a format into a ``StructuredOutput`` and
``apps.tools.choice`` turns ``tools`` + ``tool_choice`` into a ``ToolPlan``.
A shape error is a pydantic ``ValidationError`` whose first location is the
top-level field (``response_format``, ``tools``, ``tool_choice``,
``structured_outputs``, ``messages``), which ``apps.protocol.errors`` reports as the
400's ``param``.

``structured_outputs`` is vLLM's extension object (openai-python:
``extra_body={"structured_outputs": {...}}``); unlike the rest of the body it
refuses unknown keys, so an option vLLM has and we lack (``structural_tag``,
``whitespace_pattern``) is a 400 rather than silently dropped.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


# ----------------------------------------------------------- response_format
class TextFormat(_Strict):
    """``{"type": "text"}``: no constraint."""

    type: Literal["text"]


class JsonObjectFormat(_Strict):
    """``{"type": "json_object"}``: the output is one JSON object."""

    type: Literal["json_object"]


class JsonSchemaSpec(_Strict):
    """``response_format.json_schema``: ``schema`` is required; ``strict`` is accepted (we always enforce)."""

    name: str
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class JsonSchemaFormat(_Strict):
    """``{"type": "json_schema", "json_schema": {...}}``: the output matches the schema."""

    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]


class StructuredOutputsParams(BaseModel):
    """vLLM's ``structured_outputs``: exactly one of its keys (``json_object`` only when true)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


# ---------------------------------------------------------------------- tools
class FunctionDefinition(_Strict):
    """``tools[i].function``: ``parameters`` is the JSON schema of the arguments (an object schema)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Strict):
    """``tools[i]``: only function tools exist."""

    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    """``{"type": "function", "function": {"name": ...}}``: call exactly this function."""

    type: Literal["function"]
    function: ToolChoiceFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


# ------------------------------------------------------- tool calls in messages
class FunctionCall(_Strict):
    """A call's function: ``arguments`` is JSON text, as the model wrote it."""

    name: str
    arguments: str


class MessageToolCall(_Strict):
    """One call an assistant turn made (``messages[i].tool_calls[j]``)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall
