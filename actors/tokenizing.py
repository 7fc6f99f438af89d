"""What the engine and the replica both compute from a tokenizer: prompt ids, and GPT-2's byte map.

A prompt's token ids, plain text or a conversation through the tokenizer's
chat template, are computed here only: the engine (``LLMEngine.tokenize``),
the offline API (``LLM.chat``) and the replica (``apps.inputs.prompt_encoder``)
call these, so a prompt is the same token ids whichever way it arrives.
``bytes_to_unicode`` is the byte-level vocabulary's map, which the embedded
models' tokenizer is written with (``actors.load.embedded``) and the replica
reads token text back through (``apps.outputs.token_text``).

Torch-free and at the root of ``actors`` so that ``actors.api`` (the
replica's one door to the engine) can re-export it.
"""

from __future__ import annotations

from typing import Any


def text_ids(tokenizer: Any, text: str) -> list[int]:
    """``text``'s token ids, special tokens (e.g. BOS) added as the tokenizer does by default."""
    return list(tokenizer(text)["input_ids"])


def template_supports_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders ``tools`` (it mentions them; e.g. Qwen, Hermes, Llama 3.1).

    A template set (a dict of named templates) counts when any of them does:
    Hugging Face picks its ``tool_use`` template when tools are passed.
    """
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return any(isinstance(t, str) and "tools" in t for t in template.values())
    return isinstance(template, str) and "tools" in template


def chat_ids(tokenizer: Any, conversation: list[dict[str, Any]],
             tools: list[dict[str, Any]] | None = None) -> list[int]:
    """A conversation through the chat template, with the assistant's generation prompt.

    ``tools`` (OpenAI tool objects) go to the template; give them only when
    ``template_supports_tools`` says it renders them.
    """
    extra = {} if tools is None else {"tools": tools}  # only when given: not every tokenizer takes the keyword
    ids: Any = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True, **extra)
    if hasattr(ids, "keys"):  # newer transformers return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what ByteLevel uses)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars
