"""ResponseBuilder and TokenText, pure: chunk shape with n > 1, text offsets, token bytes."""

from __future__ import annotations

from pathlib import Path

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletionChunk
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from actors.api import FinishReason, SequenceDelta
from actors.load.loader import load_tokenizer
from apps.inputs.kind import RequestKind
from apps.outputs.response_builder import ResponseBuilder
from apps.outputs.token_text import TokenText
from scheduling.batch import TokenLogprobs


@pytest.fixture(scope="module")
def tiny_text(tiny_model_dir: Path) -> TokenText:
    return TokenText(load_tokenizer(tiny_model_dir))


def _d(index: int, token_ids: list[int], text: str, finish: str | None = None) -> SequenceDelta:
    entries = [TokenLogprobs(t, -0.5, [t], [-0.5]) for t in token_ids]
    return SequenceDelta(request_id="r", index=index, token_ids=token_ids, text=text, logprobs=entries,
                         finish_reason=None if finish is None else FinishReason(finish), num_prompt_tokens=3)


def _builder(kind: str, text: TokenText, n: int, logprobs: bool = True) -> ResponseBuilder:
    return ResponseBuilder(RequestKind(kind), "tiny", 1, logprobs, text.text, text.bytes_of, n)


def test_streams_send_one_choice_per_chunk(tiny_text: TokenText) -> None:
    out = _builder("chat", tiny_text, 2, logprobs=False)
    roles = out.opening_chunks("r")
    assert [[c["index"] for c in chunk["choices"]] for chunk in roles] == [[0], [1]]
    chunks = out.chunks("r", [_d(0, [104], "h"), _d(1, [105], "i"), _d(0, [33], "!", "stop")])
    assert [[c["index"] for c in chunk["choices"]] for chunk in chunks] == [[0], [1]]
    assert [chunk["choices"][0]["delta"]["content"] for chunk in chunks] == ["h!", "i"]
    assert chunks[0]["choices"][0]["finish_reason"] == "stop"
    for chunk in roles + chunks:
        ChatCompletionChunk.model_validate(chunk)
    completion = _builder("completion", tiny_text, 3, logprobs=False)
    assert completion.opening_chunks("r") == []  # only chat announces a role
    got = completion.chunks("r", [_d(2, [97], "a"), _d(1, [98], "b")])
    assert [[c["index"] for c in chunk["choices"]] for chunk in got] == [[2], [1]]


def test_text_offsets_index_the_emitted_text(tiny_text: TokenText) -> None:
    """'é' is two byte tokens: the first adds no text (held back), the second adds the character."""
    deltas = [_d(0, [0xC3], ""), _d(0, [0xA9], "é"), _d(0, [ord("x"), ord("y")], "xy", "length")]
    whole = _builder("completion", tiny_text, 1)
    for delta in deltas:
        whole.add(delta)
    [choice] = whole.choices([FinishReason.LENGTH])
    Completion.model_validate({"id": "r", "object": "text_completion", "created": 1, "model": "tiny",
                               "choices": [choice]})
    assert choice["text"] == "éxy"
    assert choice["logprobs"]["text_offset"] == [0, 0, 1, 2]
    streamed = _builder("completion", tiny_text, 1)
    offsets = [o for d in deltas for chunk in streamed.chunks("r", [d])
               for o in chunk["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == [0, 0, 1, 2]
    # A lone continuation byte is shown (as U+FFFD) only with the next token's text; specials have none.
    odd = _builder("completion", tiny_text, 1)
    for delta in [_d(0, [0xA3], ""), _d(0, [ord("^")], "\ufffd^"), _d(0, [300], ""), _d(0, [ord("z")], "z")]:
        odd.add(delta)
    [choice] = odd.choices([FinishReason.LENGTH])
    assert choice["text"] == "\ufffd^z" and choice["logprobs"]["text_offset"] == [0, 1, 2, 2]


def test_chat_logprob_bytes_are_the_tokens_own(tiny_text: TokenText) -> None:
    out = _builder("chat", tiny_text, 1)
    out.add(_d(0, [0xC3, 0xA9], "é", "stop"))
    [choice] = out.choices([FinishReason.STOP])
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == ["\ufffd", "\ufffd"]  # each half alone is not text
    assert [c["bytes"] for c in content] == [[0xC3], [0xA9]]
    assert bytes(b for c in content for b in c["bytes"]).decode() == "é"
    assert content[0]["top_logprobs"][0]["bytes"] == [0xC3]
    assert tiny_text.bytes_of(ord(" ")) == b" " and tiny_text.bytes_of(ord("\n")) == b"\n"


def test_byte_fallback_tokenizers_give_bytes_and_spaces() -> None:
    vocab = {"<unk>": 0, "<0xC3>": 1, "<0xA9>": 2, "\u2581hi": 3}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    text = TokenText(PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>"))
    assert [text.bytes_of(i) for i in (1, 2, 3)] == [b"\xc3", b"\xa9", b" hi"]
    assert text.text(1) == "\ufffd"
