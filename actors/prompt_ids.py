"""A prompt's token ids: plain text, or a conversation through the tokenizer's chat template.

The one place both are computed: the engine (``LLMEngine.tokenize``), the
offline API (``LLM.chat``) and the replica (``apps.prompt_encoder``) call
these, so a prompt is the same token ids whichever way it arrives.
"""

from __future__ import annotations

from typing import Any


def text_ids(tokenizer: Any, text: str) -> list[int]:
    """``text``'s token ids, special tokens (e.g. BOS) added as the tokenizer does by default."""
    return list(tokenizer(text)["input_ids"])


def chat_ids(tokenizer: Any, conversation: list[dict[str, str]]) -> list[int]:
    """A conversation through the chat template, with the assistant's generation prompt."""
    ids: Any = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):  # newer transformers return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)
