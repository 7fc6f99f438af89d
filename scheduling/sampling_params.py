"""Per-request sampling parameters, validated when built."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

from scheduling.errors import InvalidParameterError
from scheduling.pooling import Pooling
from scheduling.structured_output import StructuredOutput

MAX_LOGPROBS = 20
MAX_N = 16
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]

# The fields that only shape generated tokens, with their defaults: an embedding request (``pooling``
# set) generates none, so one of these set elsewhere is a caller's mistake, refused by name.
_GENERATION_ONLY: tuple[tuple[str, object], ...] = (
    ("n", 1), ("logprobs", None), ("structured_output", None), ("temperature", 1.0), ("top_p", 1.0),
    ("top_k", -1), ("min_p", 0.0), ("seed", None), ("stop", ()), ("stop_token_ids", ()), ("ignore_eos", False),
    ("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0), ("logit_bias", ()),
)


def _check_range(param: str, value: float, lo: float, hi: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidParameterError(param, f"must be a number, got {type(value).__name__}")
    if math.isnan(value) or value < lo or value > hi:
        raise InvalidParameterError(param, f"must be in [{lo}, {hi}], got {value}")


def _check_int(param: str, value: object, lo: int, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidParameterError(param, f"must be an integer, got {type(value).__name__}")
    if value < lo or (hi is not None and value > hi):
        bound = f"between {lo} and {hi}" if hi is not None else f">= {lo}"
        raise InvalidParameterError(param, f"must be {bound}, got {value}")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens for one request.

    ``temperature == 0`` is greedy. ``top_k`` of -1 or 0 disables top-k.
    ``logprobs`` asks for that many top alternatives (plus the chosen token)
    at every generated position. ``n`` sequences share the prompt.
    ``logit_bias`` adds a value in [-100, 100] to the logits of token ids
    (given as a mapping, stored as sorted ``(id, bias)`` pairs); the engine
    checks the ids against the vocabulary (``LLMEngine.add_request``).
    ``structured_output`` constrains every generated token to keep the output
    a prefix of something the constraint accepts (``actors.grammar``); the
    sequence then ends at the end-of-sequence token once the output is
    complete, so ``ignore_eos`` cannot be combined with it.
    ``lora``: the name of a LoRA adapter loaded into the engine
    (``AddLoRA``, ``actors.commands``) that serves this request; None is the base model.
    ``pooling``: set, the request is an embedding request (``scheduling.pooling``):
    its prompt's final hidden states are pooled into one vector and nothing
    is generated. ``max_tokens`` is then ignored (it neither limits nor
    counts against the prompt), ``lora`` still applies, and every field that
    only shapes generated tokens (``_GENERATION_ONLY``: ``n``, ``logprobs``,
    ``structured_output``, the sampling and penalty knobs, stops, ``seed``,
    ``logit_bias``) must stay at its default, else it is refused by name.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    n: int = 1
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    structured_output: StructuredOutput | None = None
    lora: str | None = None
    pooling: Pooling | None = None

    def __post_init__(self) -> None:
        # Accept lists from callers, store tuples so the object stays hashable/immutable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        if isinstance(self.stop_token_ids, list):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        _check_int("max_tokens", self.max_tokens, 1)
        _check_range("temperature", self.temperature, 0.0, 2.0)
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)):
            raise InvalidParameterError("top_p", "must be a number")
        if math.isnan(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidParameterError("top_p", f"must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, -1)
        _check_range("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            _check_int("seed", self.seed, -(2**63), 2**63 - 1)
        for s in self.stop:
            if not isinstance(s, str) or s == "":
                raise InvalidParameterError("stop", "stop strings must be non-empty strings")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, 0)
        if not isinstance(self.ignore_eos, bool):
            raise InvalidParameterError("ignore_eos", "must be a boolean")
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_range("repetition_penalty", self.repetition_penalty, 0.0, 10.0)
        if self.repetition_penalty == 0.0:
            raise InvalidParameterError("repetition_penalty", "must be > 0")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        _check_int("n", self.n, 1, MAX_N)
        bias = self.logit_bias
        pairs = list(bias.items()) if isinstance(bias, dict) else list(bias)
        for pair in pairs:
            if not isinstance(pair, tuple) or len(pair) != 2:
                raise InvalidParameterError("logit_bias", "must map token ids to numbers")
            _check_int("logit_bias", pair[0], 0)
            _check_range("logit_bias", pair[1], -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
        object.__setattr__(self, "logit_bias", tuple(sorted((t, float(b)) for t, b in pairs)))
        if self.lora is not None:
            check_lora_name(self.lora, "lora")
        if self.structured_output is not None:
            if not isinstance(self.structured_output, StructuredOutput):
                raise InvalidParameterError("structured_output", "must be a StructuredOutput")
            if self.ignore_eos:
                raise InvalidParameterError(
                    "ignore_eos", f"cannot be combined with {self.structured_output.param}: a constrained "
                    "output ends at the end-of-sequence token once it is complete",
                )
        if self.pooling is not None:
            self._check_embedding()

    def _check_embedding(self) -> None:
        """Refuse, by name, a generation-only field set on an embedding request."""
        if not isinstance(self.pooling, Pooling):
            raise InvalidParameterError("pooling", f"must be a Pooling or None, got {type(self.pooling).__name__}")
        for name, default in _GENERATION_ONLY:
            value = getattr(self, name)
            if value != default:
                param = self.structured_output.param if name == "structured_output" and self.structured_output else name
                raise InvalidParameterError(
                    param, f"applies to generated tokens, and an embedding request (pooling set) generates none; "
                    f"got {value!r}",
                )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def sampler_view(self) -> SamplingParams:
        """These params with every field the sampler ignores at its default, interned.

        The sampler reads temperature, top-p/k, min-p, seed, penalties,
        logprobs and logit_bias; max_tokens, stop, ignore_eos, n and
        structured_output are the engine's (a constraint reaches the sampler
        as token masks in the ``Batch``). A batch
        carries views, so requests with equal sampler settings share one
        object and a batch sent to a shard pickles it once (per-request
        objects were 87% of a 64-sequence batch's pickling time).
        """
        return _interned_view(
            self.temperature, self.top_p, self.top_k, self.min_p, self.seed,
            self.presence_penalty, self.frequency_penalty, self.repetition_penalty, self.logprobs,
            self.logit_bias,
        )


@lru_cache(maxsize=4096)
def _interned_view(
    temperature: float, top_p: float, top_k: int, min_p: float, seed: int | None,
    presence_penalty: float, frequency_penalty: float, repetition_penalty: float, logprobs: int | None,
    logit_bias: tuple[tuple[int, float], ...],
) -> SamplingParams:
    return SamplingParams(
        temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed,
        presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
        repetition_penalty=repetition_penalty, logprobs=logprobs, logit_bias=logit_bias,
    )


LORA_NAME_MAX = 128


def check_lora_name(name: object, param: str) -> str:
    """``name`` as a LoRA adapter name: 1..128 printable characters, no whitespace; else ``InvalidParameterError``."""
    if not isinstance(name, str) or not 0 < len(name) <= LORA_NAME_MAX or not name.isprintable() or any(
        c.isspace() for c in name
    ):
        raise InvalidParameterError(
            param, f"an adapter name is 1..{LORA_NAME_MAX} printable characters without spaces, got {name!r}"
        )
    return name
