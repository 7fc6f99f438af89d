"""From an HTTP body to engine inputs: parse, pick the prompt, build SamplingParams.

The HTTP layer's order is: :func:`parse_request` (size, JSON, types),
:func:`check_model`, :func:`completion_prompts` or :func:`chat_prompt`,
tokenize (the engine refuses out-of-vocabulary ids with param "prompt"), then
:func:`to_sampling_params` with each prompt's length. Every failure raises
``APIError``, ``InvalidParameterError`` or pydantic ``ValidationError``, which
``apps.protocol.errors.error_response`` turns into the OpenAI envelope.

Defaults when ``max_tokens`` is omitted: completions generate
``min(16, max_model_len - prompt)`` tokens (OpenAI's legacy default of 16);
chat generates up to ``max_model_len - prompt`` tokens (until a stop).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, TypeVar

from pydantic import BaseModel

from apps.inputs.structured import structured_output
from apps.protocol.errors import APIError
from apps.protocol.models import ChatCompletionRequest, CompletionRequest
from apps.tools.choice import tool_plan
from apps.tools.prompt import conversation, offered_tools
from scheduling.errors import InvalidParameterError
from scheduling.sampling_params import SamplingParams

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024  # 4 MiB: room for a long prompt, not a flood
DEFAULT_COMPLETION_MAX_TOKENS = 16

_JSON_KINDS = {list: "an array", str: "a string", int: "a number", float: "a number",
               bool: "a boolean", type(None): "null"}

RequestT = TypeVar("RequestT", bound=BaseModel)


def parse_request(
    body: bytes, model_cls: type[RequestT], *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
) -> RequestT:
    """Parse a raw body into ``model_cls``: 413 if too large, 400 unless a valid JSON object."""
    if len(body) > max_body_bytes:
        raise APIError(
            413, f"the request body is {len(body)} bytes; the limit is {max_body_bytes}",
            code="payload_too_large",
        )
    try:
        data = json.loads(body)
    except json.JSONDecodeError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc.msg} at position {exc.pos}") from None
    except (ValueError, RecursionError):  # bad UTF-8, absurd nesting
        raise APIError(400, "the request body is not valid JSON") from None
    if not isinstance(data, dict):
        kind = _JSON_KINDS.get(type(data), type(data).__name__)
        raise APIError(400, f"the request body must be a JSON object, got {kind}")
    where = lone_surrogate_path(data)
    if where is not None:
        raise APIError(400, "a string holds a lone UTF-16 surrogate escape (such as \\ud800): "
                            "it is not text and cannot be tokenized", param=where or None)
    return model_cls.model_validate(data)


def lone_surrogate_path(data: Any) -> str | None:
    """The dotted path of the first string (or key) with a lone surrogate, or None.

    JSON may escape one (``"\\ud800"``) and ``json.loads`` keeps it, but such a
    string is not valid Unicode text: tokenizers refuse it deep inside.
    """
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if not value.isascii() and not _encodable(value):
                return path
        elif isinstance(value, dict):
            for key, item in value.items():
                sub = f"{path}.{key}" if path else str(key)
                if not _encodable(str(key)):
                    return path
                stack.append((sub, item))
        elif isinstance(value, list):
            stack.extend((f"{path}.{i}" if path else str(i), item) for i, item in enumerate(value))
    return None


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_model(requested: str | None, served: str | Sequence[str]) -> str:
    """The model to use: the requested one if served (404 otherwise), else the first served."""
    names = [served] if isinstance(served, str) else list(served)
    if requested is None:
        return names[0]
    if requested not in names:
        raise unknown_model(requested)
    return requested


def served_name(served_model_name: str | None, model: str) -> str:
    """The name clients send for the base model: ``served_model_name``, else the model as given."""
    return served_model_name or model


def unknown_model(requested: str) -> APIError:
    """The 404 for a ``model`` that is not served (OpenAI's wording and code)."""
    return APIError(404, f"The model `{requested}` does not exist.", param="model", code="model_not_found")


def completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
    """The prompts of a completions request, in order: each a string or a list of token ids.

    ``"text"`` and ``[1, 2]`` are one prompt; ``["a", "b"]`` and
    ``[[1, 2], [3]]`` are a batch (one engine request per prompt, as OpenAI
    and vLLM serve them). An empty prompt or batch is refused.
    """
    return prompt_batch(req.prompt, "prompt")


def prompt_batch(raw: str | list[int] | list[str] | list[list[int]], param: str) -> list[str | list[int]]:
    """A prompt field (``prompt``, embeddings' ``input``) as its list of prompts (see ``completion_prompts``);
    an empty list or prompt is an ``InvalidParameterError`` naming ``param``."""
    if isinstance(raw, str) or (raw and isinstance(raw[0], int)):
        batch: list[str | list[int]] = [raw]  # a string, or one prompt of token ids
    else:
        batch = list(raw)  # type: ignore[arg-type]  # list[str] or list[list[int]] here
    if not batch:
        raise InvalidParameterError(param, f"the {param} is empty")
    for i, one in enumerate(batch):
        if len(one) == 0:
            where = f" ({param} {i} of the batch)" if len(batch) > 1 else ""
            raise InvalidParameterError(param, f"the {param} is empty{where}")
    return batch


def chat_prompt(
    req: ChatCompletionRequest, *, template_tools: bool = False
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """``(conversation, tools)`` for the chat template (``apps.tools.prompt``).

    Text content parts are joined with newlines. ``template_tools`` says the
    template knows tools: then ``tools`` is the list to pass it (None when the
    request offers none); otherwise the tools are in a system message and
    ``tools`` is None. Bad tools or tool_choice raise ``InvalidParameterError``.
    """
    plan = tool_plan(req)
    turns = conversation(req.messages, plan, template_tools=template_tools)
    return turns, (offered_tools(plan) if template_tools else None)


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The conversation as ``[{"role", "content"[, "name"]}]`` for a template that does not know tools."""
    return chat_prompt(req)[0]


def _check_completion_features(req: CompletionRequest) -> None:
    """Refuse legacy options whose meaning we would otherwise silently drop."""
    if req.echo:
        raise InvalidParameterError("echo", "echo is not supported")
    if req.suffix:
        raise InvalidParameterError("suffix", "suffix is not supported")
    if req.best_of is not None and req.best_of != (req.n or 1):
        raise InvalidParameterError("best_of", "best_of other than n is not supported")


def _max_tokens(
    req: CompletionRequest | ChatCompletionRequest, *, room: int, num_prompt_tokens: int, max_model_len: int
) -> int:
    """The request's token budget, defaulted (see the module docstring) and bounded by the context."""
    name, value = "max_tokens", req.max_tokens
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        name, value = "max_completion_tokens", req.max_completion_tokens
    if value is None:
        return room if isinstance(req, ChatCompletionRequest) else min(DEFAULT_COMPLETION_MAX_TOKENS, room)
    if isinstance(value, bool) or value < 1:
        raise InvalidParameterError(name, f"must be >= 1, got {value}")
    if value > room:
        # Same wording as the scheduler's admission check.
        raise InvalidParameterError(
            name,
            f"prompt ({num_prompt_tokens} tokens) + {name} ({value}) = "
            f"{num_prompt_tokens + value} exceeds max_model_len {max_model_len}",
        )
    return value


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """``logit_bias`` with token-id keys (the engine checks them against the vocabulary, as prompt ids)."""
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        if not (key.isascii() and key.isdigit()):
            raise InvalidParameterError("logit_bias", f"keys must be token ids, got {key!r}")
        token_id = int(key)
        out[token_id] = value
    return out


def to_sampling_params(
    req: CompletionRequest | ChatCompletionRequest, *, max_model_len: int, num_prompt_tokens: int,
) -> SamplingParams:
    """Build validated ``SamplingParams``; ranges are SamplingParams's own (errors name the field).

    Raises ``InvalidParameterError`` with param "prompt" when the prompt is
    empty or leaves no room in ``max_model_len``, with the budget's field
    name when prompt + budget exceeds ``max_model_len``, and with
    "logit_bias" for a key that is not a token id or a value outside
    [-100, 100] (ids past the vocabulary are the engine's to refuse).
    The output constraint comes from ``apps.inputs.structured``.
    """
    if num_prompt_tokens <= 0:
        raise InvalidParameterError("prompt", "the prompt is empty")
    if num_prompt_tokens >= max_model_len:
        raise InvalidParameterError(
            "prompt", f"the prompt has {num_prompt_tokens} tokens; max_model_len is {max_model_len}"
        )
    if isinstance(req, CompletionRequest):
        _check_completion_features(req)
        logprobs = req.logprobs
    else:
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = _max_tokens(
        req, room=max_model_len - num_prompt_tokens, num_prompt_tokens=num_prompt_tokens,
        max_model_len=max_model_len,
    )
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=-1 if req.top_k is None else req.top_k,
        min_p=0.0 if req.min_p is None else req.min_p,
        seed=req.seed,
        stop=stop,
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=bool(req.ignore_eos),
        presence_penalty=0.0 if req.presence_penalty is None else req.presence_penalty,
        frequency_penalty=0.0 if req.frequency_penalty is None else req.frequency_penalty,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logprobs=logprobs,
        n=1 if req.n is None else req.n,
        logit_bias=_logit_bias(req.logit_bias),  # type: ignore[arg-type]  # a dict is normalised
        structured_output=structured_output(req),
    )
