"""Finish a constrained output inside ``max_tokens``: the shortest way to a complete output, taken when the budget runs out.

Masks keep every token valid, but they cannot make a model stop: a small
model can stay inside a free JSON string ("12345678901234...") until
``max_tokens`` cuts it, and a cut output does not parse. So near the end of
its budget a constrained sequence is checked: ``ClosingPath.walk`` takes a
copy of its matcher to a complete output one byte at a time (the grammar's
forced text in one jump, then at each choice the first byte it allows of
``_PREFERRED``: close a string, an object, an array, ...), and once that walk
needs about all the tokens left, the sequence follows it (``GrammarStates``
masks each row to the walk's next token): its output ends complete, with
finish_reason "length".

The walk uses single-byte tokens, so its length in bytes bounds the tokens
it needs. It is an upper bound on the shortest completion, not the shortest:
greedy on bytes, it can miss a shorter way a choice made early would give.
"""

from __future__ import annotations

import numpy as np
import torch
import xgrammar as xgr

# Bytes tried at each choice, in order: whatever ends the innermost open thing first, then
# separators, then the shortest numbers and letters; any other single byte after these.
_PREFERRED = b'"}]),:' + b" 0123456789-.abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_"
# Longest walk tried: a completion longer than this is not looked for (the output is cut instead).
MAX_CLOSING_BYTES = 2048


class ClosingPath:
    """Shortest-completion walks for one vocabulary (the compiler's ``TokenizerInfo``)."""

    def __init__(self, info: xgr.TokenizerInfo, eos_token_id: int) -> None:
        byte_token: dict[int, int] = {}
        for token_id, text in enumerate(info.decoded_vocab):
            if len(text) == 1 and text[0] not in byte_token:
                byte_token[text[0]] = token_id
        self.byte_token = byte_token
        self.token_bytes = [len(text) for text in info.decoded_vocab]  # bytes a token adds to the output
        self.eos = eos_token_id
        tail = [b for b in range(256) if b not in _PREFERRED]
        self.candidates = [byte_token[b] for b in [*_PREFERRED, *tail] if b in byte_token]
        self._buffer = xgr.allocate_token_bitmask(1, info.vocab_size)

    def walk(self, matcher: xgr.GrammarMatcher, limit: int) -> list[int] | None:
        """Tokens of a completion from ``matcher``'s state (the end-of-sequence token last), or None.

        None when there is none within ``limit`` tokens (or no single byte
        goes on). ``matcher`` is not changed: the walk runs on a fork.
        """
        walker = matcher.fork()
        path: list[int] = []
        words = self._buffer.numpy()[0]
        while len(path) < min(limit, MAX_CLOSING_BYTES):
            forced = walker.find_jump_forward_string()
            if forced:
                tokens = [self.byte_token.get(b) for b in forced.encode()]
                if None in tokens or not walker.accept_string(forced):
                    return None
                path.extend(t for t in tokens if t is not None)
                continue
            walker.fill_next_token_bitmask(self._buffer, 0)
            if _allowed(words, self.eos):
                path.append(self.eos)
                return path if len(path) <= limit else None
            token = next((t for t in self.candidates if _allowed(words, t)), None)
            if token is None or not walker.accept_token(token):
                return None
            path.append(token)
        return None

    def force(self, token_id: int, bitmask: torch.Tensor, row: int) -> None:
        """Make ``bitmask[row]`` allow ``token_id`` alone."""
        bitmask[row].zero_()
        word, bit = divmod(token_id, 32)
        bitmask[row, word] = int(np.int32(np.uint32(1 << bit)))


def _allowed(words: np.ndarray, token_id: int) -> bool:
    return bool((int(words[token_id >> 5]) >> (token_id & 31)) & 1)
