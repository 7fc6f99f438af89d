"""``POST /v1/responses``: the request model, and its translation into a chat completions request.

The Responses API is served as a translation over the chat path: the
request becomes a ``ChatCompletionRequest`` (``to_chat``), which runs through
the same template, structured-output and tool machinery as
``/v1/chat/completions``; ``apps.responses.output`` turns the chat stream back
into Responses objects and events. Pure: no Ray, no engine.

Translation (OpenAI's semantics):

- ``instructions`` is a system turn first; it is *not* carried over by
  ``previous_response_id`` (OpenAI documents the same), the conversation is.
- ``input``: a string is one user turn; message items keep their role, their
  ``input_text``/``output_text`` parts joined with newlines (as chat joins
  text parts); consecutive ``function_call`` items are one assistant turn's
  ``tool_calls``; a ``function_call_output`` is a ``tool`` turn.
- ``max_output_tokens`` -> ``max_completion_tokens``; ``text.format``
  (``json_schema`` flat, ``json_object``, ``text``) -> ``response_format``;
  flat function ``tools`` and ``tool_choice`` -> chat's nested ones.

``metadata`` and ``user`` are kept with the stored response, so they have
OpenAI's limits (``check_limits``): at most 16 pairs, keys of at most 64
characters, values of at most 512; ``user`` at most 64 characters (the limit
of ``safety_identifier``, which OpenAI made its successor). Past them the
request is refused naming the field: unbounded, a 4 MiB body of metadata
pairs held ~35 MiB per stored response.

Errors name the Responses field: a chat field name in an error raised
downstream is mapped back through ``CHAT_TO_RESPONSES`` (``apps.protocol.errors.renamed``). Options a serving engine
cannot honour (``background``, ``conversation``, ``reasoning``, ``include``,
``truncation="auto"``, ``top_logprobs``, ``max_tool_calls``,
``parallel_tool_calls=false``) are refused, naming the field, rather than
dropped.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from apps.protocol.models import ChatCompletionRequest, ChatMessage
from apps.protocol.tools import FunctionDefinition, JsonObjectFormat, JsonSchemaSpec, TextFormat
from scheduling.errors import InvalidParameterError


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


# --------------------------------------------------------------------- input
class InputText(_Strict):
    """A text part of a message item (``output_text`` is how an earlier answer comes back as input)."""

    type: Literal["input_text", "output_text"]
    text: str


class MessageItem(_Strict):
    """``{"role", "content"}`` (``type: "message"`` optional): one turn of the conversation."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class FunctionCallItem(_Strict):
    """A call the model made in an earlier turn (``arguments`` is JSON text)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Strict):
    """The caller's answer to ``call_id``."""

    type: Literal["function_call_output"]
    call_id: str
    output: str


def _item_kind(value: Any) -> str | None:
    """An input item's kind: its ``type``, "message" when it has none (OpenAI's easy input message)."""
    if isinstance(value, dict):
        kind = value.get("type", "message")
        return kind if isinstance(kind, str) else None
    return getattr(value, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(_item_kind),
]


# ------------------------------------------------------------- text and tools
class JsonSchemaText(JsonSchemaSpec):
    """``text.format`` of type ``json_schema``: chat's ``json_schema`` spec, flat (``type`` beside it)."""

    type: Literal["json_schema"]


TextFormatConfig = Annotated[TextFormat | JsonObjectFormat | JsonSchemaText, Field(discriminator="type")]


class TextConfig(_Strict):
    """``text``: only ``format`` is served (``verbosity`` has no meaning for a plain model)."""

    format: TextFormatConfig | None = None


class FunctionTool(FunctionDefinition):
    """``tools[i]``: chat's function definition, flat (``type`` beside ``name``, not around it)."""

    type: Literal["function"]


class FunctionToolChoice(_Strict):
    """``{"type": "function", "name"}``: call exactly this function."""

    type: Literal["function"]
    name: str


class ResponsesRequest(_Strict):
    """``POST /v1/responses`` (unknown fields are ignored, as on the other endpoints)."""

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None  # vLLM-style extension (openai-python: extra_body)
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # Refused when set (see the module docstring).
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None


MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
MAX_USER_CHARS = 64

# Fields a request may not set, with what setting them would have asked for.
_REFUSED = (
    ("background", lambda r: bool(r.background), "background responses are not served; leave background unset"),
    ("conversation", lambda r: r.conversation is not None,
     "conversation objects are not served; chain turns with previous_response_id"),
    ("reasoning", lambda r: r.reasoning is not None, "reasoning options are not served by this model"),
    ("include", lambda r: bool(r.include), "no extra output data can be included"),
    ("truncation", lambda r: r.truncation == "auto",
     "automatic truncation is not served: an input over the context is refused"),
    ("top_logprobs", lambda r: bool(r.top_logprobs), "logprobs are not served on /v1/responses"),
    ("max_tool_calls", lambda r: r.max_tool_calls is not None, "max_tool_calls is not served"),
    ("parallel_tool_calls", lambda r: r.parallel_tool_calls is False,
     "parallel_tool_calls=false is not served: an auto tool choice may call several tools"),
)

# Chat field -> the Responses field a user wrote it as (for errors raised on the chat request).
CHAT_TO_RESPONSES = {"messages": "input", "max_completion_tokens": "max_output_tokens",
                     "max_tokens": "max_output_tokens", "response_format": "text", "prompt": "input"}


def check_limits(req: ResponsesRequest) -> None:
    """Refuse ``metadata`` and ``user`` past OpenAI's limits (``InvalidParameterError`` naming the field)."""
    metadata = req.metadata or {}
    if len(metadata) > MAX_METADATA_PAIRS:
        raise InvalidParameterError("metadata", f"at most {MAX_METADATA_PAIRS} key-value pairs, got {len(metadata)}")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise InvalidParameterError("metadata", f"key '{key[:MAX_METADATA_KEY_CHARS]}...' is {len(key)} "
                                                    f"characters; the limit is {MAX_METADATA_KEY_CHARS}")
        if len(value) > MAX_METADATA_VALUE_CHARS:
            raise InvalidParameterError("metadata", f"the value of '{key}' is {len(value)} characters; the limit "
                                                    f"is {MAX_METADATA_VALUE_CHARS}")
    if req.user is not None and len(req.user) > MAX_USER_CHARS:
        raise InvalidParameterError("user", f"{len(req.user)} characters; the limit is {MAX_USER_CHARS}")


def check_supported(req: ResponsesRequest) -> None:
    """Refuse the options this server cannot honour (``InvalidParameterError`` naming the field)."""
    for name, is_set, why in _REFUSED:
        if is_set(req):
            raise InvalidParameterError(name, why)


def input_messages(req: ResponsesRequest) -> list[ChatMessage]:
    """This request's ``input`` as chat turns (without ``instructions``)."""
    if isinstance(req.input, str):
        if not req.input:
            raise InvalidParameterError("input", "the input is empty")
        return [ChatMessage(role="user", content=req.input)]
    if not req.input:
        raise InvalidParameterError("input", "the input is an empty list")
    turns: list[ChatMessage] = []
    for item in req.input:
        if isinstance(item, MessageItem):
            turns.append(ChatMessage(role=item.role, content=item.text))
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = turns[-1] if turns else None
            if last is not None and last.role == "assistant" and last.tool_calls and not last.content:
                turns[-1] = ChatMessage.model_validate(
                    {"role": "assistant", "tool_calls": [*(c.model_dump() for c in last.tool_calls), call]})
            else:
                turns.append(ChatMessage.model_validate({"role": "assistant", "tool_calls": [call]}))
        else:
            turns.append(ChatMessage(role="tool", content=item.output, tool_call_id=item.call_id))
    return turns


def _response_format(text: TextConfig | None) -> dict[str, Any] | None:
    fmt = None if text is None else text.format
    if fmt is None or isinstance(fmt, TextFormat):
        return None
    if isinstance(fmt, JsonObjectFormat):
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": fmt.model_dump(by_alias=True, exclude={"type"}, exclude_none=True)}


def _tool_choice(choice: str | FunctionToolChoice | None) -> str | dict[str, Any] | None:
    if isinstance(choice, FunctionToolChoice):
        return {"type": "function", "function": {"name": choice.name}}
    return choice


def to_chat(req: ResponsesRequest, history: list[ChatMessage]) -> ChatCompletionRequest:
    """The chat request that serves ``req``, continuing ``history`` (the turns of ``previous_response_id``)."""
    check_limits(req)
    check_supported(req)
    turns: list[ChatMessage] = []
    if req.instructions:
        turns.append(ChatMessage(role="system", content=req.instructions))
    turns += history
    turns += input_messages(req)
    body: dict[str, Any] = {
        "model": req.model, "messages": [t.model_dump(exclude_none=True) for t in turns],
        "max_completion_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
        "seed": req.seed, "stream": bool(req.stream), "response_format": _response_format(req.text),
        "tool_choice": _tool_choice(req.tool_choice),
    }
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in req.tools]
    return ChatCompletionRequest.model_validate(body)
