"""When one generated sequence stops, decided in one place, token by token.

``BatchPolicy.update`` calls ``StopRule.on_token`` for every sampled token; it
returns the text that token makes safe to emit and the finish reason, if
the sequence ends there:

- ``"stop"``: a stop token (EOS unless ``ignore_eos``; any id of
  ``stop_token_ids``) or a completed stop string;
- ``"length"``: ``max_tokens`` tokens generated (the scheduler refuses, at
  admission, a prompt + ``max_tokens`` past ``max_model_len``, so this is
  also the model-length limit).

Text comes from a ``TextStream`` the engine injects (its incremental
detokenizer); without one (scheduler benchmarks, tests of scheduling alone)
the rule still decides on tokens and lengths and emits no text.

Stop strings: no emitted character lies at or past the start of a stop
string. To keep that while streaming, the rule holds back the longest tail
of the text that is a proper prefix of some stop string (at most max length
- 1 characters): that tail may yet grow into a stop string, and is released
once it cannot. Every completed occurrence is found when its last character
arrives, and the one that completes first wins, so the result does not
depend on how the text was split into deltas. When the sequence ends for
any reason, the detokenizer's held-back bytes are flushed through the stop
strings first (they may complete one: then the reason is ``"stop"``), so no
complete character before the end is lost. Stop tokens and stop strings are
never part of the emitted text.
"""

from __future__ import annotations

from typing import Protocol

from scheduling.finish_reason import FinishReason
from scheduling.sampling_params import SamplingParams


class TextStream(Protocol):
    """Text of one sequence produced token by token (``actors.engine.detokenizer.IncrementalDetokenizer``)."""

    def add(self, token_id: int) -> str:
        """Append one generated token; the text it completes (maybe "")."""
        ...

    def flush(self) -> str:
        """Whatever is held back, even an incomplete character."""
        ...


class NoText:
    """A ``TextStream`` that produces no text: stops are decided on tokens and lengths only."""

    def add(self, token_id: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


_NO_TEXT = NoText()


class StopRule:
    """Decides, token by token, what text is safe to emit and whether the sequence stops."""

    __slots__ = ("_stop_token_ids", "_stop_strings", "_partial_stops", "_max_hold", "_max_tokens",
                 "_text", "_held", "_finish_reason")

    def __init__(self, params: SamplingParams, eos_token_id: int | None,
                 text: TextStream | None = None) -> None:
        stop_ids = set(params.stop_token_ids)
        if eos_token_id is not None and not params.ignore_eos:
            stop_ids.add(eos_token_id)
        self._stop_token_ids = frozenset(stop_ids)
        self._stop_strings = params.stop
        # Every prefix of a stop string shorter than the string itself: a tail
        # of the text in this set must be held back.
        self._partial_stops = frozenset(s[:k] for s in params.stop for k in range(1, len(s)))
        self._max_hold = max((len(s) - 1 for s in params.stop), default=0)
        self._max_tokens = params.max_tokens
        self._text: TextStream = _NO_TEXT if text is None else text
        self._held = ""
        self._finish_reason: FinishReason | None = None

    @property
    def finish_reason(self) -> FinishReason | None:
        """``"stop"`` or ``"length"`` once the sequence ended, else None."""
        return self._finish_reason

    @property
    def held_text(self) -> str:
        """Text received but not yet emitted (a possible stop-string start)."""
        return self._held

    def on_token(self, token_id: int, num_output_tokens: int) -> tuple[str, FinishReason | None]:
        """Take one generated token; ``num_output_tokens`` counts it.

        Returns (text safe to emit now, finish reason or None).
        """
        assert self._finish_reason is None, "sequence already stopped"
        if token_id in self._stop_token_ids:  # its own text is never emitted
            return self._end(FinishReason.STOP)
        text, reason = self._check(self._text.add(token_id))
        if reason is not None or num_output_tokens < self._max_tokens:
            return text, reason
        tail, reason = self._end(FinishReason.LENGTH)
        return text + tail, reason

    def _end(self, reason: FinishReason) -> tuple[str, FinishReason]:
        """Flush the held-back bytes through the stop strings, then release what is held."""
        tail, found = self._check(self._text.flush())
        if found is not None:
            return tail, found
        text, self._held = tail + self._held, ""
        self._finish_reason = reason
        return text, reason

    def _check(self, text_delta: str) -> tuple[str, FinishReason | None]:
        """Emit what ``text_delta`` makes safe; "stop" when it completes a stop string."""
        if not self._stop_strings:
            return text_delta, None
        text = self._held + text_delta
        stop_at = self._find_stop(text)
        if stop_at is not None:
            # Everything from the stop string on is dropped, forever.
            self._held = ""
            self._finish_reason = FinishReason.STOP
            return text[:stop_at], FinishReason.STOP
        hold = self._hold_length(text)
        self._held = text[len(text) - hold:] if hold else ""
        return text[: len(text) - hold], None

    def _find_stop(self, text: str) -> int | None:
        """Start of the stop-string occurrence that completes first in ``text``, if any.

        Ties (two occurrences ending on the same character) go to the longer
        one, which starts earlier: streaming one character at a time would
        see both complete at that character.
        """
        best: tuple[int, int] | None = None  # (end, start)
        for stop in self._stop_strings:
            start = text.find(stop)
            if start < 0:
                continue
            # The first occurrence of a fixed string also ends first.
            candidate = (start + len(stop), start)
            if best is None or candidate < best:
                best = candidate
        return None if best is None else best[1]

    def _hold_length(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
        for k in range(min(self._max_hold, len(text)), 0, -1):
            if text[-k:] in self._partial_stops:
                return k
        return 0
