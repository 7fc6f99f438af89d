"""StopChecker: stop strings while streaming, stop token ids, eos and ignore_eos."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from actors.stop_checker import StopChecker
from scheduling.sampling_params import SamplingParams

EOS = 2
TEXT_TOKEN = 100  # any id that is neither eos nor a stop token


def _run(checker: StopChecker, deltas: list[str]) -> tuple[list[str], str | None]:
    """Feed text deltas as ordinary tokens; on no stop, end as the caller would (finish)."""
    emitted: list[str] = []
    for delta in deltas:
        out, reason = checker.on_token(TEXT_TOKEN, delta)
        emitted.append(out)
        if reason is not None:
            return emitted, reason
    emitted.append(checker.finish())
    return emitted, None


def _stops(*stop: str) -> StopChecker:
    return StopChecker(SamplingParams(stop=tuple(stop)), eos_token_id=EOS)


def test_no_stop_strings_pass_text_through() -> None:
    checker = _stops()
    assert checker.on_token(TEXT_TOKEN, "hello") == ("hello", None)
    assert checker.on_token(TEXT_TOKEN, " world") == (" world", None)
    assert checker.finish() == ""


def test_stop_string_split_across_tokens() -> None:
    emitted, reason = _run(_stops("END"), ["abc E", "N", "D tail"])
    assert reason == "stop"
    assert "".join(emitted) == "abc "
    # "E" and "N" were held back: they could have been (and were) a stop start.
    assert emitted == ["abc ", "", ""]


def test_held_text_released_when_not_a_stop() -> None:
    checker = _stops("END")
    assert checker.on_token(TEXT_TOKEN, "xE") == ("x", None)
    assert checker.held_text == "E"
    assert checker.on_token(TEXT_TOKEN, "Nx") == ("ENx", None)
    assert checker.held_text == ""


def test_only_possible_stop_prefixes_are_held() -> None:
    checker = _stops("###")
    # No tail of "hello" starts "###": nothing needs holding.
    assert checker.on_token(TEXT_TOKEN, "hello") == ("hello", None)
    assert checker.on_token(TEXT_TOKEN, " ##") == (" ", None)
    assert checker.finish() == "##"


def test_stop_at_very_start() -> None:
    emitted, reason = _run(_stops("Hello"), ["Hello world"])
    assert (emitted, reason) == ([""], "stop")


def test_stop_string_is_whole_delta_and_nothing_after_is_emitted() -> None:
    checker = _stops("\n\n")
    assert checker.on_token(TEXT_TOKEN, "para one") == ("para one", None)
    assert checker.on_token(TEXT_TOKEN, "\n\nmore text") == ("", "stop")
    assert checker.finish_reason == "stop"
    assert checker.finish() == ""


def test_overlapping_candidates() -> None:
    # "aab" inside "aaab": the first "aa" is a false start that must be released.
    emitted, reason = _run(_stops("aab"), ["a", "a", "a", "b", "c"])
    assert reason == "stop"
    assert "".join(emitted) == "a"
    # Self-overlapping stop string, completing late.
    emitted, reason = _run(_stops("abab"), ["x", "aba", "aba", "b"])
    assert reason == "stop"
    assert "".join(emitted) == "xaba"


def test_multiple_stop_strings_earliest_wins() -> None:
    emitted, reason = _run(_stops("world", "lo"), ["hello world"])
    assert reason == "stop"
    assert "".join(emitted) == "hel"
    # Order in the list does not matter.
    emitted, _ = _run(_stops("lo", "world"), ["hel", "lo world"])
    assert "".join(emitted) == "hel"
    # Two occurrences completing on the same character: the longer one
    # (which starts earlier) wins.
    emitted, _ = _run(_stops("c", "abc"), ["xab", "cd"])
    assert "".join(emitted) == "x"


def test_stop_token_ids_stop_and_add_no_text() -> None:
    checker = StopChecker(SamplingParams(stop_token_ids=(7, 9), stop=("zz",)), eos_token_id=EOS)
    assert checker.on_token(TEXT_TOKEN, "abz") == ("ab", None)
    # The held "z" is released: "zz" can no longer complete. The token's own
    # text is dropped.
    assert checker.on_token(9, "<tok9>") == ("z", "stop")
    assert checker.finish() == ""


def test_eos_stops_unless_ignored() -> None:
    checker = StopChecker(SamplingParams(), eos_token_id=EOS)
    assert checker.on_token(TEXT_TOKEN, "hi") == ("hi", None)
    assert checker.on_token(EOS, "</s>") == ("", "stop")

    ignoring = StopChecker(SamplingParams(ignore_eos=True), eos_token_id=EOS)
    assert ignoring.on_token(EOS, "") == ("", None)
    assert ignoring.finish_reason is None
    # ignore_eos does not turn off explicit stop token ids, even the eos id.
    explicit = StopChecker(SamplingParams(ignore_eos=True, stop_token_ids=(EOS,)), EOS)
    assert explicit.on_token(EOS, "") == ("", "stop")

    no_eos = StopChecker(SamplingParams(), eos_token_id=None)
    assert no_eos.on_token(EOS, "x") == ("x", None)


def test_is_stop_token_matches_what_on_token_stops_on() -> None:
    checker = StopChecker(SamplingParams(stop_token_ids=(7,)), eos_token_id=EOS)
    assert [checker.is_stop_token(t) for t in (7, EOS, TEXT_TOKEN)] == [True, True, False]
    ignoring = StopChecker(SamplingParams(ignore_eos=True), eos_token_id=EOS)
    assert not ignoring.is_stop_token(EOS)


def test_on_text_checks_flushed_text() -> None:
    checker = _stops("STOP")
    assert checker.on_token(TEXT_TOKEN, "abST") == ("ab", None)
    assert checker.on_text("OP!") == ("", "stop")


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
    checker = _stops(*stops)
    emitted, reason = _run(checker, deltas)
    expected, stopped = _reference(text, stops)
    assert "".join(emitted) == expected
    assert (reason == "stop") == stopped
    # While streaming, no emitted prefix ever ran into a stop string.
    so_far = ""
    for piece in emitted:
        so_far += piece
        assert not any(s in so_far for s in stops)
