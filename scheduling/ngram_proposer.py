"""Prompt-lookup drafts: continue the sequence the way it continued before.

The sequence's last n tokens (n from ``max_n`` down to ``min_n``: the longest
match first) are searched for earlier in the sequence, latest occurrence
first; the tokens that followed it are the draft. A reply that copies its
prompt (an edit, a quote, code) finds its next tokens this way at no cost.
"""

from __future__ import annotations


def propose_ngram(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` draft tokens continuing ``tokens``; empty when no n-gram recurs."""
    length = len(tokens)
    if k <= 0:
        return []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        pattern = tokens[length - n:]
        last = pattern[-1]
        # Candidate ends e (exclusive) run from the latest earlier one back;
        # the continuation tokens[e:e + k] must exist (e < length).
        for end in range(length - 1, n - 1, -1):
            if tokens[end - 1] == last and tokens[end - n:end] == pattern:
                return tokens[end:end + k]
    return []
