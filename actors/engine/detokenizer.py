"""Incremental detokenization: token ids in, text deltas out, one token at a time.

The vLLM scheme with two offsets into the token list:

    ids:  ... | prefix_offset ... read_offset | ... (pending) ...
               `--- already emitted ---------'

``decode(ids[prefix:read])`` is text already emitted; ``decode(ids[prefix:])``
is that plus whatever the pending tokens add. The difference is the delta.
Decoding a few tokens of context before the pending ones (rather than the
pending ones alone) keeps tokenizer rules that depend on the neighbour intact,
e.g. SentencePiece dropping the leading space of the first token of a decode.

Invariants: ``prefix_offset <= read_offset <= len(ids)``; when text is
emitted, ``prefix_offset`` moves to the old ``read_offset`` and ``read_offset``
to the end, so each decode covers only the last emitted chunk plus the
pending tokens: the cost per token does not grow with sequence length.
A delta is held back while the decoded text ends in U+FFFD: the pending
tokens end inside a multi-byte character whose remaining bytes are yet to come.
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase

# Prompt tokens decoded as context before the first generated token.
_INITIAL_CONTEXT = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Text of one generated sequence, produced token by token.

    ``prompt_token_ids`` are context only: their text is never emitted.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        # A fast tokenizer's Rust backend, when there is one (see _decode).
        self._backend: Any = getattr(tokenizer, "_tokenizer", None) if tokenizer.is_fast else None
        self._skip_special_tokens = skip_special_tokens
        # Only the prompt's tail matters as context; keeping the list short
        # also keeps slicing cheap. Two extra tokens give the first decode a
        # chance to start on a character boundary.
        self._ids: list[int] = list(prompt_token_ids[-(_INITIAL_CONTEXT + 2) :])
        self._read_offset = len(self._ids)
        self._prefix_offset = max(self._read_offset - _INITIAL_CONTEXT, 0)
        # The decoded text of ids[prefix:read], cached: it only changes when
        # the offsets move.
        self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        self._chunks: list[str] = []

    @property
    def text(self) -> str:
        """Everything emitted so far (the deltas concatenated)."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def add(self, token_id: int) -> str:
        """Append one generated token; return the text it completes (maybe "")."""
        self._ids.append(token_id)
        new_text = self._decode(self._prefix_offset, len(self._ids))
        if len(new_text) <= len(self._prefix_text) or new_text.endswith(_REPLACEMENT):
            # Nothing new yet (a special token skipped) or a character is
            # still incomplete: wait for more tokens.
            return ""
        return self._emit(new_text)

    def flush(self) -> str:
        """Emit whatever is held back, even an incomplete character (as U+FFFD)."""
        if self._read_offset == len(self._ids):
            return ""
        new_text = self._decode(self._prefix_offset, len(self._ids))
        if len(new_text) <= len(self._prefix_text):
            return ""
        return self._emit(new_text)

    def _emit(self, new_text: str) -> str:
        delta = new_text[len(self._prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        # Drop ids before the window so the list (and slicing) stays short.
        if self._prefix_offset > 0:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        self._chunks.append(delta)
        return delta

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        if self._backend is not None:
            # The Rust tokenizer directly: the same text (no clean-up is asked
            # for), without the Python wrapper's per-call overhead.
            fast: str = self._backend.decode(self._ids[start:end], skip_special_tokens=self._skip_special_tokens)
            return fast
        text = self._tokenizer.decode(
            self._ids[start:end],
            skip_special_tokens=self._skip_special_tokens,
            # Clean-up rewrites spaces around punctuation depending on the
            # neighbours, which a window cannot see: deltas would not add up.
            clean_up_tokenization_spaces=False,
        )
        assert isinstance(text, str)
        return text
