"""StopRule: stop strings while streaming, stop token ids, eos and ignore_eos, max_tokens, flushes."""

from __future__ import annotations

from collections import deque

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduling.sampling_params import SamplingParams
from scheduling.stop_rule import StopRule

EOS = 2
TEXT_TOKEN = 100  # any id that is neither eos nor a stop token
BIG = 10_000  # a max_tokens no test reaches unless it means to


class Script:
    """A TextStream whose tokens add the given deltas, in order; ``flush`` returns ``held``."""

    def __init__(self, *deltas: str, held: str = "") -> None:
        self.deltas = deque(deltas)
        self.held = held

    def add(self, token_id: int) -> str:
        return self.deltas.popleft()

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held


def _rule(*deltas: str, stop: tuple[str, ...] = (), max_tokens: int = BIG, held: str = "",
          **params: object) -> StopRule:
    return StopRule(SamplingParams(stop=stop, max_tokens=max_tokens, **params),  # type: ignore[arg-type]
                    eos_token_id=EOS, text=Script(*deltas, held=held))


def _run(deltas: list[str], stops: tuple[str, ...]) -> tuple[list[str], str | None]:
    """Feed text deltas as ordinary tokens, the last one reaching max_tokens (which releases held text)."""
    if not deltas:
        return [], None
    rule = _rule(*deltas, stop=stops, max_tokens=len(deltas))
    emitted: list[str] = []
    for k in range(len(deltas)):
        out, reason = rule.on_token(TEXT_TOKEN, k + 1)
        emitted.append(out)
        if reason is not None:
            return emitted, reason
    raise AssertionError("max_tokens did not end the sequence")


def test_no_stop_strings_pass_text_through_and_max_tokens_ends_with_length() -> None:
    rule = _rule("hello", " world", max_tokens=2)
    assert rule.on_token(TEXT_TOKEN, 1) == ("hello", None)
    assert rule.on_token(TEXT_TOKEN, 2) == (" world", "length")
    assert rule.finish_reason == "length"


def test_stop_string_split_across_tokens() -> None:
    emitted, reason = _run(["abc E", "N", "D tail"], ("END",))
    assert reason == "stop"
    assert "".join(emitted) == "abc "
    # "E" and "N" were held back: they could have been (and were) a stop start.
    assert emitted == ["abc ", "", ""]


def test_held_text_released_when_not_a_stop() -> None:
    rule = _rule("xE", "Nx", stop=("END",))
    assert rule.on_token(TEXT_TOKEN, 1) == ("x", None)
    assert rule.held_text == "E"
    assert rule.on_token(TEXT_TOKEN, 2) == ("ENx", None)
    assert rule.held_text == ""


def test_only_possible_stop_prefixes_are_held_and_length_releases_them() -> None:
    rule = _rule("hello", " ##", stop=("###",), max_tokens=2)
    # No tail of "hello" starts "###": nothing needs holding.
    assert rule.on_token(TEXT_TOKEN, 1) == ("hello", None)
    assert rule.on_token(TEXT_TOKEN, 2) == (" ##", "length")  # " " emitted, "##" released at the end


def test_stop_at_very_start() -> None:
    assert _run(["Hello world"], ("Hello",)) == ([""], "stop")


def test_stop_string_is_whole_delta_and_nothing_after_is_emitted() -> None:
    rule = _rule("para one", "\n\nmore text", stop=("\n\n",))
    assert rule.on_token(TEXT_TOKEN, 1) == ("para one", None)
    assert rule.on_token(TEXT_TOKEN, 2) == ("", "stop")
    assert rule.finish_reason == "stop"


def test_overlapping_candidates() -> None:
    # "aab" inside "aaab": the first "aa" is a false start that must be released.
    emitted, reason = _run(["a", "a", "a", "b", "c"], ("aab",))
    assert reason == "stop"
    assert "".join(emitted) == "a"
    # Self-overlapping stop string, completing late.
    emitted, reason = _run(["x", "aba", "aba", "b"], ("abab",))
    assert reason == "stop"
    assert "".join(emitted) == "xaba"


def test_multiple_stop_strings_earliest_wins() -> None:
    emitted, reason = _run(["hello world"], ("world", "lo"))
    assert reason == "stop"
    assert "".join(emitted) == "hel"
    # Order in the list does not matter.
    emitted, _ = _run(["hel", "lo world"], ("lo", "world"))
    assert "".join(emitted) == "hel"
    # Two occurrences completing on the same character: the longer one
    # (which starts earlier) wins.
    emitted, _ = _run(["xab", "cd"], ("c", "abc"))
    assert "".join(emitted) == "x"


def test_stop_token_ids_stop_and_add_no_text() -> None:
    rule = _rule("abz", stop=("zz",), stop_token_ids=(7, 9))
    assert rule.on_token(TEXT_TOKEN, 1) == ("ab", None)
    # The held "z" is released: "zz" can no longer complete. The token's own
    # text is never asked for (the script holds no delta for it).
    assert rule.on_token(9, 2) == ("z", "stop")


def test_eos_stops_unless_ignored() -> None:
    rule = _rule("hi")
    assert rule.on_token(TEXT_TOKEN, 1) == ("hi", None)
    assert rule.on_token(EOS, 2) == ("", "stop")

    ignoring = _rule("", ignore_eos=True)
    assert ignoring.on_token(EOS, 1) == ("", None)
    assert ignoring.finish_reason is None
    # ignore_eos does not turn off explicit stop token ids, even the eos id.
    explicit = _rule(ignore_eos=True, stop_token_ids=(EOS,))
    assert explicit.on_token(EOS, 1) == ("", "stop")

    no_eos = StopRule(SamplingParams(), eos_token_id=None, text=Script("x"))
    assert no_eos.on_token(EOS, 1) == ("x", None)


def test_a_stop_token_flushes_held_bytes_through_the_stop_strings() -> None:
    # The detokenizer held "é" back (an open character): the stop token releases it.
    rule = _rule("ab", held="é")
    assert rule.on_token(TEXT_TOKEN, 1) == ("ab", None)
    assert rule.on_token(EOS, 2) == ("é", "stop")
    # Flushed bytes that complete a stop string end it there, with "stop".
    rule = _rule("abST", held="OP!", stop=("STOP",))
    assert rule.on_token(TEXT_TOKEN, 1) == ("ab", None)
    assert rule.on_token(EOS, 2) == ("", "stop")


def test_a_stop_string_completed_by_the_final_flush_reports_stop_not_length() -> None:
    rule = _rule("abST", held="OP!", stop=("STOP",), max_tokens=1)
    assert rule.on_token(TEXT_TOKEN, 1) == ("ab", "stop")
    rule = _rule("abST", held="X", stop=("STOP",), max_tokens=1)
    assert rule.on_token(TEXT_TOKEN, 1) == ("abSTX", "length")


def test_without_a_text_stream_tokens_and_lengths_still_decide() -> None:
    rule = StopRule(SamplingParams(max_tokens=2, stop=("x",)), eos_token_id=EOS)
    assert rule.on_token(TEXT_TOKEN, 1) == ("", None)
    assert rule.on_token(TEXT_TOKEN, 2) == ("", "length")
    assert StopRule(SamplingParams(), eos_token_id=EOS).on_token(EOS, 1) == ("", "stop")


def _reference(text: str, stops: list[str]) -> tuple[str, bool]:
    """Emitted text when seeing ``text`` one character at a time: stop at the first completion."""
    for end in range(1, len(text) + 1):
        hits = [end - len(s) for s in stops if text[:end].endswith(s)]
        if hits:
            return text[: min(hits)], True
    return text, False


@settings(max_examples=600, deadline=None, derandomize=True)
@given(
    text=st.text(alphabet="abc\n", max_size=30),
    stops=st.lists(st.text(alphabet="abc\n", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(min_value=0, max_value=30), max_size=10),
)
def test_any_chunking_matches_reference(text: str, stops: list[str], cuts: list[int]) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    emitted, reason = _run(deltas, tuple(stops))
    expected, stopped = _reference(text, stops)
    assert "".join(emitted) == expected
    assert (reason == "stop") == stopped
    # While streaming, no emitted prefix ever ran into a stop string.
    so_far = ""
    for piece in emitted:
        so_far += piece
        assert not any(s in so_far for s in stops)
