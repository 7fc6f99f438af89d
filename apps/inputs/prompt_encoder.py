"""Prompts and chat conversations to token ids, and token ids back to text, off the event loop when long.

A replica's one event loop also fans out every stream's deltas, so a long
tokenization there stalls every stream for its whole length. Prompts of at
least ``OFFLOAD_MIN_CHARS`` characters are encoded in a worker thread
(``asyncio.to_thread``); shorter ones inline.

Why 2,048 characters: encoding costs a fixed part plus a part per
character, and a hop to a thread and back a fixed cost
(docs/design_costs.md has them). Below the threshold an inline encode
stalls the loop for less than one decode step, and a thread hop would be a
large share of the work; above it the stall grows with the prompt while the
hop stays the same.
Short requests, the latency-sensitive ones, never pay the hop. Decoding
(``/detokenize``) takes the same path by its number of tokens: each token is
at least one character of text, so a token count at the threshold is at least
as much work as an encode there.

Thread safety: a fast tokenizer's encode borrows its Rust state shared
(only changing truncation or padding borrows it exclusively, which we never
do), so encodes in threads and on the loop may overlap.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from actors.api import chat_ids, template_supports_tools, text_ids

OFFLOAD_MIN_CHARS = 2048
T = TypeVar("T")


class PromptEncoder:
    """Encodes prompts and decodes ids with one tokenizer; ``encode``/``encode_chat``/``decode`` pick inline or
    a thread by size."""

    def __init__(self, tokenizer: Any, *, offload_min_chars: int = OFFLOAD_MIN_CHARS) -> None:
        self.tokenizer = tokenizer
        self.offload_min_chars = offload_min_chars
        self.supports_tools = template_supports_tools(tokenizer)  # the chat template renders ``tools``

    def ids(self, prompt: str) -> list[int]:
        """A text prompt's token ids (on the calling thread)."""
        return text_ids(self.tokenizer, prompt)

    def chat_ids(self, conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """A conversation (and ``tools``) through the chat template, with the generation prompt (this thread)."""
        return chat_ids(self.tokenizer, conversation, tools)

    async def encode(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt (token-id prompts pass through; the engine checks their range)."""
        if not isinstance(prompt, str):
            return list(prompt)
        return await self._run(len(prompt), self.ids, prompt)

    async def encode_chat(self, conversation: list[dict[str, Any]],
                          tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of a conversation; long ones (content and tools) are rendered in a thread."""
        size = sum(len(turn.get("content") or "") for turn in conversation)
        if tools:
            size += sum(len(str(tool)) for tool in tools)
        return await self._run(size, self.chat_ids, conversation, tools)

    async def decode(self, ids: list[int]) -> str:
        """The text of token ids (``tokenizer.decode``); many ids are decoded in a thread."""
        return await self._run(len(ids), self.tokenizer.decode, ids)

    async def _run(self, size: int, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``: in a worker thread when ``size`` (characters, or tokens) reaches the threshold, else here."""
        if size >= self.offload_min_chars:
            return await asyncio.to_thread(fn, *args)
        return fn(*args)
