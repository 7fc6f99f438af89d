"""Speculative decoding settings (vLLM's ``speculative_config`` shape), validated when built.

Two methods propose ``num_speculative_tokens`` draft tokens per decoding
sequence per step, which the target model then verifies in one forward:

- ``{"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": a, "prompt_lookup_max": b}``:
  prompt lookup. The last n tokens (n from b down to a) are searched for
  earlier in the sequence; the K tokens that followed the latest earlier
  occurrence are the draft. Costs no forward.
- ``{"method": "draft", "model": PATH_OR_PRESET, "num_speculative_tokens": K}``: a smaller model
  with the same tokenizer drafts greedily; ``{"method": "draft", "layers": N, ...}`` drafts
  with the target's own first N layers and its head (a self-draft: it shares
  the target's KV pages for those layers, so it needs no memory of its own).

Adaptive off-switches (the engine never speculates where it does not pay;
the defaults are measured, see docs/speculative.md):

- ``min_acceptance``: a sequence whose drafts were accepted at a rate below it,
  over its last ``acceptance_window`` drafted steps, stops speculating for
  ``cooldown_tokens`` generated tokens, then tries again; and while the
  engine's recent acceptance is below it, steps draft only now and then (to
  keep measuring it), so a drafter that is never right costs little.
- ``busy_batch_size`` and ``busy_min_acceptance``: a step with at least
  ``busy_batch_size`` running sequences drafts only while the engine's recent
  acceptance is at least ``busy_min_acceptance`` (probing now and then to
  follow the workload). In a big batch the forward is compute-bound, so a
  draft token costs about what a real one does: only drafts that are nearly
  always right pay there.
- ``disable_by_batch_size``: a step with at least this many running sequences
  does not speculate at all; None never switches off by batch size.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from scheduling.errors import InvalidParameterError
from scheduling.json_object import parse_json_object

SPEC_METHODS = ("ngram", "draft")
_PARAM = "speculative_config"


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """What to draft, how many tokens, and when not to."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    model: str | None = None
    layers: int | None = None
    disable_by_batch_size: int | None = None
    min_acceptance: float = 0.25
    busy_batch_size: int = 16
    busy_min_acceptance: float = 0.8
    acceptance_window: int = 4
    cooldown_tokens: int = 32

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise InvalidParameterError(_PARAM, f"method must be one of {', '.join(SPEC_METHODS)}, got {self.method!r}")
        _positive("num_speculative_tokens", self.num_speculative_tokens)
        if self.num_speculative_tokens > 16:
            raise InvalidParameterError(_PARAM, f"num_speculative_tokens must be <= 16, got {self.num_speculative_tokens}")
        if self.method == "ngram":
            if self.model is not None or self.layers is not None:
                raise InvalidParameterError(_PARAM, "'model' and 'layers' belong to method 'draft', not 'ngram'")
            _positive("prompt_lookup_min", self.prompt_lookup_min)
            _positive("prompt_lookup_max", self.prompt_lookup_max)
            if self.prompt_lookup_min > self.prompt_lookup_max:
                raise InvalidParameterError(
                    _PARAM, f"prompt_lookup_min ({self.prompt_lookup_min}) exceeds "
                    f"prompt_lookup_max ({self.prompt_lookup_max})",
                )
        else:
            if (self.model is None) == (self.layers is None):
                raise InvalidParameterError(
                    _PARAM, "method 'draft' needs exactly one of 'model' (a draft model) or 'layers' "
                    "(a self-draft from the target's first N layers)",
                )
            if self.model is not None and (not isinstance(self.model, str) or not self.model):
                raise InvalidParameterError(_PARAM, f"model must be a model folder or preset name, got {self.model!r}")
            if self.layers is not None:
                _positive("layers", self.layers)
        if self.disable_by_batch_size is not None:
            _positive("disable_by_batch_size", self.disable_by_batch_size)
        for name in ("min_acceptance", "busy_min_acceptance"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 <= value <= 1.0):
                raise InvalidParameterError(_PARAM, f"{name} must be in [0, 1], got {value!r}")
        _positive("busy_batch_size", self.busy_batch_size)
        _positive("acceptance_window", self.acceptance_window)
        _positive("cooldown_tokens", self.cooldown_tokens)

    @property
    def drafts_in_runner(self) -> bool:
        """True when the model runner drafts (a draft model), False when the scheduler does (n-gram)."""
        return self.method == "draft"

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """From a config, a dict or its JSON text (``--speculative-config``); None stays None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = parse_json_object(value, _PARAM, (f.name for f in fields(cls)), "field")
        for required in ("method", "num_speculative_tokens"):
            if required not in value:
                raise InvalidParameterError(_PARAM, f"needs {required!r}")
        return cls(**value)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidParameterError(_PARAM, f"{name} must be an integer >= 1, got {value!r}")
