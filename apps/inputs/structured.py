"""A request's output constraint: ``response_format``, ``structured_outputs`` or a tool_choice -> ``StructuredOutput``.

At most one source may constrain a request: a ``response_format`` other than
text, vLLM's ``structured_outputs`` (exactly one key), or a chat
``tool_choice`` of "required" or a named function (``apps.tools.choice``).
Two of them together are a 400 naming the second. ``json_schema.strict`` is
accepted and changes nothing: a constraint is always enforced. Whether a
schema, regex or grammar compiles is the engine's to say (it raises
``InvalidParameterError`` naming the ``param`` carried here).
"""

from __future__ import annotations

from apps.protocol.models import ChatCompletionRequest, CompletionRequest
from apps.protocol.tools import (
    JsonObjectFormat,
    JsonSchemaFormat,
    StructuredOutputsParams,
    TextFormat,
)
from apps.tools.choice import ToolMode, tool_plan
from scheduling.errors import InvalidParameterError
from scheduling.structured_output import StructuredOutput

FORMAT_PARAM = "response_format"
EXTENSION_PARAM = "structured_outputs"


def from_response_format(fmt: TextFormat | JsonObjectFormat | JsonSchemaFormat | None) -> StructuredOutput | None:
    """``response_format``'s constraint: none for text, any object for json_object, the schema for json_schema."""
    if fmt is None or isinstance(fmt, TextFormat):
        return None
    if isinstance(fmt, JsonObjectFormat):
        return StructuredOutput.json_object(param=FORMAT_PARAM)
    return StructuredOutput.json_schema(fmt.json_schema.schema_, param=FORMAT_PARAM)


def from_structured_outputs(params: StructuredOutputsParams | None) -> StructuredOutput | None:
    """vLLM's ``structured_outputs``: exactly one of json, regex, choice, grammar, json_object (true)."""
    if params is None:
        return None
    given = {key for key in ("json", "regex", "choice", "grammar") if getattr(params, _attr(key)) is not None}
    if params.json_object:
        given.add("json_object")
    if len(given) != 1:
        found = f"got {sorted(given)}" if given else "got none"
        raise InvalidParameterError(
            EXTENSION_PARAM, f"set exactly one of json, regex, choice, grammar or json_object (true); {found}")
    key = given.pop()
    param = f"{EXTENSION_PARAM}.{key}"
    if key == "json":
        assert params.json_ is not None
        return StructuredOutput.json_schema(params.json_, param=param)
    if key == "regex":
        assert params.regex is not None
        return StructuredOutput.regex(params.regex, param=param)
    if key == "choice":
        assert params.choice is not None
        return StructuredOutput.choice(params.choice, param=param)
    if key == "grammar":
        assert params.grammar is not None
        return StructuredOutput.grammar(params.grammar, param=param)
    return StructuredOutput.json_object(param=param)


def _attr(key: str) -> str:
    return "json_" if key == "json" else key


def structured_output(req: CompletionRequest | ChatCompletionRequest) -> StructuredOutput | None:
    """The request's one output constraint, or None; two sources together raise ``InvalidParameterError``."""
    fmt = from_response_format(req.response_format)
    extension = from_structured_outputs(req.structured_outputs)
    if fmt is not None and extension is not None:
        raise InvalidParameterError(
            EXTENSION_PARAM, "cannot be combined with a response_format other than text: give one of them")
    chosen = fmt or extension
    if isinstance(req, ChatCompletionRequest):
        plan = tool_plan(req)
        tools = plan.constraint()
        if tools is not None:
            if chosen is not None:
                field = FORMAT_PARAM if fmt is not None else EXTENSION_PARAM
                shown = "'required'" if plan.mode is ToolMode.REQUIRED else "naming a function"
                raise InvalidParameterError(
                    field, f"cannot be combined with a tool_choice {shown}, which constrains the output itself")
            return tools
    return chosen
