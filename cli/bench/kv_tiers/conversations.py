"""The seeded multi-turn chat workload of ``flotilla bench kv-tiers``, and its no-reuse counterpart.

Conversation ``c`` opens with ``passages`` of the shipped passages (a seeded
choice) and a question about them; each later turn asks one more question.
Every turn resends the whole conversation through the model's chat template:
the earlier turns, each answer as the model gave it, the new question.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from cli.bench.workload import chat_texts

ChatTokenizer = PreTrainedTokenizerBase


@dataclass
class Conversation:
    """One user's chat: the questions still to ask, the messages so far."""

    index: int
    questions: list[str]
    messages: list[dict[str, str]] = field(default_factory=list)

    @property
    def turn(self) -> int:
        """The 1-based number of the next turn."""
        return sum(m["role"] == "user" for m in self.messages) + 1

    def next_prompt(self, tokenizer: ChatTokenizer) -> list[int]:
        self.messages.append({"role": "user", "content": self.questions[self.turn - 1]})
        text = tokenizer.apply_chat_template(self.messages, tokenize=False, add_generation_prompt=True)
        assert isinstance(text, str)
        return list(tokenizer.encode(text, add_special_tokens=False))

    def answer(self, tokenizer: ChatTokenizer, token_ids: list[int]) -> None:
        text = tokenizer.decode(token_ids, skip_special_tokens=True)
        assert isinstance(text, str)
        self.messages.append({"role": "assistant", "content": text})


def conversations(count: int, turns: int, passages: int, seed: int) -> list[Conversation]:
    """``count`` seeded conversations of ``turns`` questions, the first about ``passages`` passages."""
    texts = chat_texts()
    rng = random.Random(seed)
    out = []
    for c in range(count):
        chosen = rng.sample(texts.passages, min(passages, len(texts.passages)))
        asks = rng.sample(texts.questions_about_text, len(texts.questions_about_text))
        asks += rng.sample(texts.instructions, len(texts.instructions))
        first = "\n\n".join(chosen) + "\n\n" + asks[0]
        out.append(Conversation(c, [first, *asks[1:turns]]))
    return out


def unique_prompts(tokenizer: ChatTokenizer, count: int, length: int, seed: object) -> list[list[int]]:
    """``count`` prompts of ``length`` tokens that share no page with each other (nor with earlier seeds):
    each starts with its own seeded token run, then shipped prose."""
    texts = chat_texts()
    prose = tokenizer.encode(" ".join(texts.passages), add_special_tokens=False)
    rng = random.Random(f"no-reuse-{seed!r}")
    out = []
    for _ in range(count):
        head = [rng.randrange(len(tokenizer)) for _ in range(8)]
        start = rng.randrange(0, max(len(prose) - length, 1))
        out.append((head + prose[start : start + length])[:length])
    return out
