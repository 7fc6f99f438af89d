"""Prompts and chat conversations to token ids, off the event loop when they are long.

A replica's one event loop also fans out every stream's deltas, so a long
tokenization there stalls every stream for its whole length. Prompts of at
least ``OFFLOAD_MIN_CHARS`` characters are encoded in a worker thread
(``asyncio.to_thread``); shorter ones inline.

Why 2,048 characters: measured on the tiny model's byte-level tokenizer
(2-core box), encoding costs ~0.2 us a character plus ~40 us (chat template:
~70 us), and a hop to a thread and back ~50 us. Below 2,048 characters an
inline encode stalls the loop for under ~0.5 ms, less than one decode step,
and a thread hop would be a tenth or more of the work; above it the stall
grows without bound (64 K characters: ~20 ms) while the hop stays ~50 us.
Short requests, the latency-sensitive ones, never pay the hop.

Thread safety: a fast tokenizer's encode borrows its Rust state shared
(only changing truncation or padding borrows it exclusively, which we never
do), so encodes in threads and on the loop may overlap.
"""

from __future__ import annotations

import asyncio
from typing import Any

from actors.prompt_ids import chat_ids, template_supports_tools, text_ids

OFFLOAD_MIN_CHARS = 2048


class PromptEncoder:
    """Encodes prompts with one tokenizer; ``encode``/``encode_chat`` pick inline or a thread by length."""

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
        if len(prompt) >= self.offload_min_chars:
            return await asyncio.to_thread(self.ids, prompt)
        return self.ids(prompt)

    async def encode_chat(self, conversation: list[dict[str, Any]],
                          tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of a conversation; long ones (content and tools) are rendered in a thread."""
        size = sum(len(turn.get("content") or "") for turn in conversation)
        if tools:
            size += sum(len(str(tool)) for tool in tools)
        if size >= self.offload_min_chars:
            return await asyncio.to_thread(self.chat_ids, conversation, tools)
        return self.chat_ids(conversation, tools)
