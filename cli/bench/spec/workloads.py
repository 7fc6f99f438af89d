"""Chat workloads for ``flotilla bench spec``: replies that copy the prompt, and replies that do not.

Speculative decoding pays when drafts are right. An n-gram (prompt lookup)
draft is right when the reply repeats the prompt, a draft model when the
reply is predictable; so one workload of each kind, both real English from
``cli.bench.workload.chat_texts``:

- ``edit``: the user gives one or two passages and asks for them back with a
  small change (a word replaced, typos fixed, a title added), so most of the
  reply is a copy of the prompt: the best case of prompt lookup.
- ``questions``: open questions (the texts' instructions) whose answers are new
  text: the draft has little to copy, so this shows what speculation costs
  when it mostly misses.

Both are lists of chat lines (``cli/bench/workload.py``'s format) and are
deterministic for a seed. The word swaps an edit may ask for are
``data/spec_edit_swaps.json``.
"""

from __future__ import annotations

import functools
import json
import random
import re
from pathlib import Path
from typing import Any

from cli.bench.workload import DATA_DIR, chat_texts
from scheduling.errors import InvalidParameterError

WORKLOADS = ("edit", "questions")
# A reply that repeats one passage fits in 128 tokens, two in 192 (docs/benchmarks.md: the passages' tokens).
EDIT_MAX_TOKENS = {1: 128, 2: 192}
QUESTIONS_MAX_TOKENS = 128
EDIT_KINDS = ("replace", "typos", "title")


@functools.cache
def swaps() -> tuple[tuple[str, str], ...]:
    """Word swaps an editor might ask for, ``(word, replacement)``; a request uses one whose word is in its text."""
    pairs = json.loads((DATA_DIR / "spec_edit_swaps.json").read_text(encoding="utf-8"))
    return tuple((word, repl) for word, repl in pairs)


def _swaps_in(text: str) -> list[tuple[str, str]]:
    return [(w, r) for w, r in swaps() if re.search(rf"\b{w}\b", text)]


def _with_typos(text: str, rng: random.Random, num_typos: int) -> str:
    """``text`` with two adjacent letters swapped in ``num_typos`` distinct words of 5+ letters."""
    words = text.split(" ")
    candidates = [i for i, w in enumerate(words) if w.isalpha() and len(w) >= 5]
    for i in rng.sample(candidates, min(num_typos, len(candidates))):
        w = words[i]
        # Keep the first and last letters (a typo, not a new word); swapping equal letters changes nothing.
        spots = [j for j in range(1, len(w) - 2) if w[j] != w[j + 1]]
        if spots:
            j = rng.choice(spots)
            words[i] = w[:j] + w[j + 1] + w[j] + w[j + 2:]
    return " ".join(words)


def edit_requests(num_requests: int, seed: int) -> list[dict[str, Any]]:
    """``num_requests`` chats asking for one or two passages back with a small edit."""
    rng = random.Random(f"edit:{seed}")
    out = []
    for _ in range(num_requests):
        num_passages = rng.choice((1, 2))
        text = "\n\n".join(rng.sample(chat_texts().passages, num_passages))
        kind = rng.choice(EDIT_KINDS)
        swaps = _swaps_in(text)
        if kind == "replace" and swaps:
            word, repl = rng.choice(swaps)
            content = (f"Repeat the following text exactly, but replace the word \"{word}\" "
                       f"with \"{repl}\":\n\n{text}")
        elif kind == "typos":
            content = f"Fix the typos in this text and return it in full:\n\n{_with_typos(text, rng, 4)}"
        else:
            content = f"Add a short title above the following text, then repeat the text unchanged:\n\n{text}"
        out.append({"messages": [{"role": "user", "content": content}], "max_tokens": EDIT_MAX_TOKENS[num_passages]})
    return out


def questions_requests(num_requests: int, seed: int) -> list[dict[str, Any]]:
    """``num_requests`` open questions, every one asked once before any repeats."""
    instructions = chat_texts().instructions
    rng = random.Random(f"questions:{seed}")
    order: list[str] = []
    while len(order) < num_requests:
        order += rng.sample(instructions, len(instructions))
    return [{"messages": [{"role": "user", "content": q}], "max_tokens": QUESTIONS_MAX_TOKENS}
            for q in order[:num_requests]]


def write_workloads(out_dir: str | Path, *, num_requests: int = 16, seed: int = 0) -> dict[str, str]:
    """Write ``edit.jsonl`` and ``questions.jsonl`` into ``out_dir``; returns their paths by name."""
    if not isinstance(num_requests, int) or num_requests < 1:
        raise InvalidParameterError("num_requests", f"must be >= 1, got {num_requests!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, build in (("edit", edit_requests), ("questions", questions_requests)):
        path = out / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in build(num_requests, seed)))
        paths[name] = str(path)
    return paths
