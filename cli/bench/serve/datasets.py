"""Request sets for ``flotilla bench serve``: random, shared-prefix, multi-turn, real-text chat, or JSONL.

Every generator is deterministic for a seed, so one config reproduces a run.
Prompts are token ids drawn from ``[0, vocab)`` (exact lengths for any
tokenizer that accepts ids, as vLLM's and flotilla's completions APIs do) or,
with ``prompt_format="text"``, lowercase words of about one token per letter
on byte-level tokenizers. Multi-turn chat always sends text messages. ``chat``
sends real English (``cli.bench.workload.chat_texts``) for a trained model: an
instruction alone, or 1-4 passages and a question about them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from cli.bench.workload import BenchRequest, chat_texts, read_workload
from scheduling.errors import InvalidParameterError

DATASETS = ("random", "shared-prefix", "multi-turn", "chat", "jsonl")
# Passages a chat prompt quotes at most (docs/benchmarks.md gives the prompts' token counts).
MAX_CHAT_PASSAGES = 4


@dataclass(frozen=True, slots=True)
class DatasetConfig:
    """What to generate; unused fields are ignored by a dataset that does not need them."""

    name: str = "random"
    num_prompts: int = 64
    input_len: tuple[int, int] = (32, 256)  # inclusive range
    output_len: tuple[int, int] = (32, 128)
    vocab: int = 256
    prompt_format: str = "ids"  # "ids" | "text"
    seed: int = 0
    # shared-prefix: ``num_groups`` groups of ``prompts_per_group``, each sharing a prefix
    num_groups: int = 4
    prompts_per_group: int = 8
    prefix_len: int = 128
    # multi-turn: ``num_conversations`` of ``num_turns`` user turns
    num_conversations: int = 8
    num_turns: int = 4
    path: str | None = None  # jsonl

    def __post_init__(self) -> None:
        if self.name not in DATASETS:
            raise InvalidParameterError("dataset", f"must be one of {', '.join(DATASETS)}, got {self.name!r}")
        if self.prompt_format not in ("ids", "text"):
            raise InvalidParameterError("prompt_format", f"must be ids or text, got {self.prompt_format!r}")
        for param, (lo, hi) in (("input_len", self.input_len), ("output_len", self.output_len)):
            if not 1 <= lo <= hi:
                raise InvalidParameterError(param, f"need 1 <= min <= max, got {lo}..{hi}")
        for param in ("num_prompts", "vocab", "num_groups", "prompts_per_group", "num_conversations", "num_turns"):
            if getattr(self, param) < 1:
                raise InvalidParameterError(param, f"must be >= 1, got {getattr(self, param)}")
        if self.prefix_len < 0:
            raise InvalidParameterError("prefix_len", f"must be >= 0, got {self.prefix_len}")
        if self.name == "jsonl" and not self.path:
            raise InvalidParameterError("dataset_path", "the jsonl dataset needs a path")


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def _words(rng: random.Random, n: int) -> str:
    """About ``n`` characters of lowercase words (one token each on a byte-level tokenizer)."""
    out: list[str] = []
    size = 0
    while size < n:
        word = "".join(chr(97 + rng.randrange(26)) for _ in range(rng.randint(2, 8)))
        out.append(word)
        size += len(word) + 1
    return " ".join(out)[:n]


def _prompt(rng: random.Random, n: int, cfg: DatasetConfig) -> str | list[int]:
    return _ids(rng, n, cfg.vocab) if cfg.prompt_format == "ids" else _words(rng, n)


def random_requests(cfg: DatasetConfig) -> list[BenchRequest]:
    rng = random.Random(cfg.seed)
    out = []
    for _ in range(cfg.num_prompts):
        n = rng.randint(*cfg.input_len)
        out.append(BenchRequest(rng.randint(*cfg.output_len), prompt=_prompt(rng, n, cfg), num_prompt_tokens=n))
    return out


def shared_prefix_requests(cfg: DatasetConfig) -> list[BenchRequest]:
    """``num_groups * prompts_per_group`` requests; those of a group share a ``prefix_len`` prefix.

    Groups are interleaved (g0, g1, ..., g0, g1, ...) so a router's prefix
    affinity and the replica's prefix cache both matter.
    """
    rng = random.Random(cfg.seed)
    prefixes = [_prompt(rng, cfg.prefix_len, cfg) for _ in range(cfg.num_groups)]
    out = []
    for _ in range(cfg.prompts_per_group):
        for prefix in prefixes:
            n = rng.randint(*cfg.input_len)
            body = _prompt(rng, n, cfg)
            prompt = prefix + body if isinstance(prefix, list) and isinstance(body, list) else f"{prefix} {body}"
            out.append(BenchRequest(rng.randint(*cfg.output_len), prompt=prompt,
                                    num_prompt_tokens=cfg.prefix_len + n))
    return out


def multi_turn_requests(cfg: DatasetConfig) -> list[BenchRequest]:
    """Chat requests: turn ``k`` of a conversation carries its first ``k`` exchanges as history.

    The assistant replies in the history are synthetic (fixed per seed), so
    every turn can be sent without waiting for the previous one and the same
    history prefix recurs, as it does in a real chat. Turns are ordered turn
    by turn across conversations.
    """
    rng = random.Random(cfg.seed)
    convs = []
    for _ in range(cfg.num_conversations):
        turns = []
        for _ in range(cfg.num_turns):
            user = _words(rng, rng.randint(*cfg.input_len))
            reply_len = rng.randint(*cfg.output_len)
            turns.append((user, _words(rng, reply_len), reply_len))
        convs.append(turns)
    out = []
    for k in range(cfg.num_turns):
        for turns in convs:
            history: list[dict[str, str]] = []
            for user, reply, _ in turns[:k]:
                history += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
            user, _, reply_len = turns[k]
            messages = [*history, {"role": "user", "content": user}]
            out.append(BenchRequest(reply_len, messages=messages,
                                    num_prompt_tokens=sum(len(m["content"]) for m in messages)))
    return out


def chat_requests(cfg: DatasetConfig) -> list[BenchRequest]:
    """``num_prompts`` single-turn chats of real text, ``max_tokens`` drawn from ``output_len``.

    A third are instructions alone; the rest quote 1-4 passages and ask about
    them. ``input_len`` is not used: the lengths are those of the text.
    """
    texts = chat_texts()
    rng = random.Random(cfg.seed)
    out = []
    for _ in range(cfg.num_prompts):
        num_passages = rng.randint(1, MAX_CHAT_PASSAGES) if rng.random() < 2 / 3 else 0
        if num_passages:
            quoted = "\n\n".join(rng.sample(texts.passages, num_passages))
            content = f"{quoted}\n\n{rng.choice(texts.questions_about_text)}"
        else:
            content = rng.choice(texts.instructions)
        out.append(BenchRequest(rng.randint(*cfg.output_len), messages=[{"role": "user", "content": content}],
                                num_prompt_tokens=len(content) // 4))  # ~4 characters a BPE token
    return out


def jsonl_requests(cfg: DatasetConfig) -> list[BenchRequest]:
    """A make_workload.py file: ``{"prompt_token_ids": [...], "max_tokens": N}`` per line (first ``num_prompts``)."""
    assert cfg.path is not None
    reqs = read_workload(Path(cfg.path))
    return [BenchRequest(r["max_tokens"], prompt=r["prompt_token_ids"], num_prompt_tokens=len(r["prompt_token_ids"]))
            for r in reqs[: cfg.num_prompts]]


def build_requests(cfg: DatasetConfig) -> list[BenchRequest]:
    """The requests ``cfg`` describes, in sending order."""
    build = {"random": random_requests, "shared-prefix": shared_prefix_requests,
             "multi-turn": multi_turn_requests, "chat": chat_requests, "jsonl": jsonl_requests}[cfg.name]
    return build(cfg)
