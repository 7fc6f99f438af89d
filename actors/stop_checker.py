"""Stop tokens and stop strings for one generated sequence, checked as text streams out.

Invariant: no emitted character lies at or past the start of a stop string.
To keep it while streaming, the checker holds back the longest tail of the
text that is a proper prefix of some stop string (at most max length - 1
characters): that tail may yet grow into a stop string, and is released once
it cannot. Because every completed occurrence is found when its last
character arrives, and the occurrence that completes first wins, the result
does not depend on how the text was split into deltas.

``max_tokens`` ("length") is the caller's business; the caller then calls
``finish()`` to release the held-back text. Before a stop token or the end,
the caller also passes the detokenizer's held-back tail through ``on_text``
(it may complete a stop string), so no complete character is lost.
"""

from __future__ import annotations

from scheduling.sampling_params import SamplingParams

FINISH_STOP = "stop"


class StopChecker:
    """Decides, token by token, what text is safe to emit and whether to stop.

    ``eos_token_id`` stops the sequence unless ``params.ignore_eos``; any id in
    ``params.stop_token_ids`` always does. Stop tokens and stop strings are
    not part of the emitted text.
    """

    def __init__(self, params: SamplingParams, eos_token_id: int | None) -> None:
        stop_ids = set(params.stop_token_ids)
        if eos_token_id is not None and not params.ignore_eos:
            stop_ids.add(eos_token_id)
        self._stop_token_ids = frozenset(stop_ids)
        self._stop_strings = params.stop
        # Every prefix of a stop string shorter than the string itself: a tail
        # of the text in this set must be held back.
        self._partial_stops = frozenset(s[:k] for s in params.stop for k in range(1, len(s)))
        self._max_hold = max((len(s) - 1 for s in params.stop), default=0)
        self._held = ""
        self._finish_reason: str | None = None

    @property
    def finish_reason(self) -> str | None:
        """``"stop"`` once a stop token or string was seen, else None."""
        return self._finish_reason

    @property
    def held_text(self) -> str:
        """Text received but not yet emitted (a possible stop-string start)."""
        return self._held

    def is_stop_token(self, token_id: int) -> bool:
        """Whether ``token_id`` ends the sequence (its own text is never emitted)."""
        return token_id in self._stop_token_ids

    def on_token(self, token_id: int, text_delta: str) -> tuple[str, str | None]:
        """Take one generated token and the text it added.

        Returns (text safe to emit now, finish reason or None). A stop token
        releases the held-back text (the stop string it might have started
        can no longer complete) and adds none of its own.
        """
        assert self._finish_reason is None, "sequence already stopped"
        if token_id in self._stop_token_ids:
            self._finish_reason = FINISH_STOP
            return self._release(), FINISH_STOP
        return self.on_text(text_delta)

    def on_text(self, text_delta: str) -> tuple[str, str | None]:
        """Check text that arrives without a token of its own, e.g. a detokenizer flush."""
        assert self._finish_reason is None, "sequence already stopped"
        if not self._stop_strings:
            return text_delta, None
        text = self._held + text_delta
        stop_at = self._find_stop(text)
        if stop_at is not None:
            # Everything from the stop string on is dropped, forever.
            self._held = ""
            self._finish_reason = FINISH_STOP
            return text[:stop_at], FINISH_STOP
        hold = self._hold_length(text)
        self._held = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold], None

    def finish(self) -> str:
        """End the sequence for another reason (length, abort): release the held-back text."""
        return self._release()

    def _release(self) -> str:
        text, self._held = self._held, ""
        return text

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
