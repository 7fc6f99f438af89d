"""One token's text and its own bytes, for logprobs.

``decode([id])`` of a token that holds part of a UTF-8 character (byte-level
BPE splits characters; the tiny model's tokens are single bytes) gives
U+FFFD, whose UTF-8 is not the token's bytes. OpenAI's chat logprobs carry
``bytes`` so a client can join tokens back into text: they must be the
token's own. They are read from the vocabulary entry:

- byte-level BPE (GPT-2, Llama 3, SmolLM2, the tiny model): each character of
  the entry stands for one byte through GPT-2's reversible byte map;
- byte-fallback SentencePiece (Llama 2, Mistral): ``<0xAB>`` is byte 0xAB and
  ``▁`` is a space;
- special and added tokens, and any other tokenizer: the decoded text's UTF-8.
"""

from __future__ import annotations

import json
import re
from typing import Any

from actors.api import bytes_to_unicode  # GPT-2's byte map: one copy in the repo

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPIECE_SPACE = "\u2581"


def _decoder_types(tokenizer: Any) -> set[str]:
    """The ``type`` names of a fast tokenizer's decoder (and of a Sequence's parts); empty if unknown."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return set()
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    parts = decoder.get("decoders") if decoder.get("type") == "Sequence" else [decoder]
    return {str(part.get("type")) for part in parts or [] if isinstance(part, dict)}


class TokenText:
    """Per-token text (``text``) and bytes (``bytes_of``) of one tokenizer; bytes are cached per id."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        kinds = _decoder_types(tokenizer)
        self._byte_level = "ByteLevel" in kinds
        self._byte_fallback = "ByteFallback" in kinds
        self._byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
        self._special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
        self._bytes: dict[int, bytes] = {}

    def text(self, token_id: int) -> str:
        """The token decoded alone (U+FFFD where it holds part of a character)."""
        return str(self._tokenizer.decode([token_id]))

    def bytes_of(self, token_id: int) -> bytes:
        """The token's own bytes: the pieces of a character are not U+FFFD."""
        cached = self._bytes.get(token_id)
        if cached is None:
            cached = self._bytes[token_id] = self._raw_bytes(token_id)
        return cached

    def _raw_bytes(self, token_id: int) -> bytes:
        if token_id not in self._special:
            entry = self._tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(entry, str):
                if self._byte_level and all(c in self._byte_of for c in entry):
                    return bytes(self._byte_of[c] for c in entry)
                if self._byte_fallback:
                    match = _BYTE_TOKEN.fullmatch(entry)
                    if match:
                        return bytes([int(match.group(1), 16)])
                    return entry.replace(_SPIECE_SPACE, " ").encode("utf-8")
        return self.text(token_id).encode("utf-8")
