"""What the benchmarks send: the offline benchmarks' JSONL workload, a request of the HTTP ones, the shipped texts.

The JSONL workload: ``../shared/peers/make_workload.py``'s format, or chats.

One request a line, either token ids or a conversation:

    {"prompt_token_ids": [...], "max_tokens": N}
    {"messages": [{"role": "user", "content": "..."}], "max_tokens": N}

Token-id lines suit any model (the peers' format); chat lines suit a trained
model whose replies matter (``flotilla bench spec``: what a draft can copy
depends on the text). Chat lines need the model's tokenizer, so they are
read with ``chat=True`` and turned into ids by ``workload_prompt_ids``;
readers that take only ids keep the default and get a clear error instead.

``BenchRequest`` is one request of an HTTP benchmark (``bench serve``,
``bench pd``) and the body it is sent with. The benchmarks' data files
(``data/``: texts, schemas; ``data/README.md`` says where each comes from)
are read from ``DATA_DIR``; ``chat_texts`` is the real English that
``bench serve``'s ``chat`` dataset and ``bench spec-workloads`` send.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from actors.tokenizing import chat_ids
from scheduling.errors import InvalidParameterError

CHAT_ROLES = ("system", "user", "assistant")
DATA_DIR = Path(__file__).parent / "data"


def is_chat(req: dict[str, Any]) -> bool:
    """True for a chat line (``messages``), False for a token-id line."""
    return "messages" in req


def _check_messages(messages: Any) -> str | None:
    """Why ``messages`` is not a conversation, or None when it is one."""
    if not isinstance(messages, list) or not messages:
        return "messages must be a non-empty list"
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or set(m) != {"role", "content"}:
            return f"messages[{i}] must be an object with exactly 'role' and 'content'"
        if m["role"] not in CHAT_ROLES:
            return f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {m['role']!r}"
        if not isinstance(m["content"], str) or not m["content"]:
            return f"messages[{i}].content must be a non-empty string"
    return None


def _parse_line(obj: Any, *, chat: bool) -> dict[str, Any]:
    """One request of the workload; raises ValueError with the reason (the caller adds the line)."""
    if not isinstance(obj, dict):
        raise ValueError(f"a line must be a JSON object, got {type(obj).__name__}")
    has_ids, has_chat = "prompt_token_ids" in obj, "messages" in obj
    if has_ids == has_chat:
        raise ValueError("need exactly one of 'prompt_token_ids' or 'messages'")
    max_tokens = obj.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ValueError(f"need max_tokens >= 1, got {max_tokens!r}")
    if has_chat:
        if not chat:
            raise ValueError("a chat line ('messages'); this benchmark takes only 'prompt_token_ids'")
        why = _check_messages(obj["messages"])
        if why is not None:
            raise ValueError(why)
        return {"messages": obj["messages"], "max_tokens": max_tokens}
    ids = obj["prompt_token_ids"]
    if not isinstance(ids, list) or not ids:
        raise ValueError("need a non-empty prompt_token_ids list")
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise ValueError("prompt_token_ids must be integers >= 0")
    return {"prompt_token_ids": ids, "max_tokens": max_tokens}


def read_workload(path: str | Path, *, chat: bool = False) -> list[dict[str, Any]]:
    """Parse and check a JSONL workload; a bad line is an error naming its number.

    Each request is a dict with ``max_tokens`` and either ``prompt_token_ids``
    or (only with ``chat=True``) ``messages``.
    """
    p = Path(path)
    if not p.is_file():
        raise InvalidParameterError("workload", f"{p} is not a file")
    reqs = []
    for lineno, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            reqs.append(_parse_line(json.loads(line), chat=chat))
        except ValueError as e:  # json.JSONDecodeError is a ValueError too
            raise InvalidParameterError("workload", f"{p}:{lineno}: {e}") from e
    if not reqs:
        raise InvalidParameterError("workload", f"{p} holds no requests")
    return reqs


def workload_prompt_ids(reqs: list[dict[str, Any]], tokenizer: Any) -> list[list[int]]:
    """Each request's prompt token ids: as given, or the conversation through the chat template."""
    return [chat_ids(tokenizer, r["messages"]) if is_chat(r) else list(r["prompt_token_ids"]) for r in reqs]


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request to send: a completion ``prompt`` or chat ``messages``, and its ``max_tokens``."""

    max_tokens: int
    prompt: str | list[int] | None = None
    messages: list[dict[str, str]] | None = None
    num_prompt_tokens: int = 0  # as generated (ids, or text length); the server's usage is authoritative

    @property
    def endpoint(self) -> str:
        return "/v1/chat/completions" if self.messages is not None else "/v1/completions"

    def body(self, model: str, *, temperature: float, ignore_eos: bool) -> dict[str, Any]:
        """The JSON body of the request, streamed with usage (the benchmarks count tokens from it)."""
        body: dict[str, Any] = {"model": model, "max_tokens": self.max_tokens, "temperature": temperature,
                                "stream": True, "stream_options": {"include_usage": True}}
        if ignore_eos:
            body["ignore_eos"] = True  # vLLM's extension, also flotilla's: every request does its full work
        if self.messages is not None:
            body["messages"] = self.messages
        else:
            body["prompt"] = self.prompt
        return body


@dataclass(frozen=True, slots=True)
class ChatTexts:
    """Real English for chat prompts (``data/chat_texts.json``): instructions, and passages to ask about."""

    instructions: tuple[str, ...]
    questions_about_text: tuple[str, ...]
    passages: tuple[str, ...]


@functools.cache
def chat_texts() -> ChatTexts:
    """The shipped chat texts, read once per process."""
    data = json.loads((DATA_DIR / "chat_texts.json").read_text(encoding="utf-8"))
    return ChatTexts(tuple(data["instructions"]), tuple(data["questions_about_text"]), tuple(data["passages"]))
