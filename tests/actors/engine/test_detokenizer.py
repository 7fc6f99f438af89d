"""IncrementalDetokenizer against tokenizer.decode as the oracle, on two small local tokenizers.

Both tokenizers are trained here (no hub): a GPT-2-style byte-level BPE, and a
Llama-style Metaspace BPE with byte fallback, whose decoder strips the leading
space of the first token (the case that needs context tokens). With few
merges, accented letters, CJK and emoji span several tokens each.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from actors.engine.detokenizer import IncrementalDetokenizer

_CORPUS = ["hello world, the quick brown fox jumps over the lazy dog."] * 20 + [
    "héllo wörld ñandú ça va",
    "日本語のテキスト 中文文本",
]
_ALPHABET = "abc xyz,.!?\néàüñçß日本語中文テキストкириллицаعربي😀🎉👍🏽👨‍👩‍👧\u0301"


def _wrap(tok: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        clean_up_tokenization_spaces=False,
    )


def _byte_level() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<s>", "</s>"],
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer)
    return _wrap(tok)


def _metaspace() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=120, special_tokens=["<s>", "</s>"], limit_alphabet=40, show_progress=False
    )
    tok.train_from_iterator(_CORPUS[:20], trainer)
    # Add the 256 byte tokens and the Llama decoder chain by editing the JSON:
    # the trainer cannot add byte-fallback tokens as ordinary vocabulary.
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    spec["decoder"] = {
        "type": "Sequence",
        "decoders": [
            {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0},
        ],
    }
    return _wrap(Tokenizer.from_str(json.dumps(spec)))


_TOKENIZERS: dict[str, PreTrainedTokenizerFast] = {
    "byte_level": _byte_level(),
    "metaspace": _metaspace(),
}
TOKENIZER_NAMES = list(_TOKENIZERS)


def _encode(tok: PreTrainedTokenizerFast, text: str) -> list[int]:
    ids = tok.encode(text, add_special_tokens=False)
    assert isinstance(ids, list)
    return ids


def _oracle(tok: PreTrainedTokenizerFast, ids: list[int], skip: bool = True) -> str:
    text = tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
    assert isinstance(text, str)
    return text


def _stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.add(t) for t in ids]


@pytest.mark.parametrize("name", TOKENIZER_NAMES)
def test_multibyte_characters_span_several_tokens(name: str) -> None:
    # Precondition of every other test here: without it they prove little.
    tok = _TOKENIZERS[name]
    for ch in ["😀", "日", "👍🏽"]:
        assert len(_encode(tok, "a" + ch)) >= 3


@pytest.mark.parametrize("name", TOKENIZER_NAMES)
@settings(max_examples=300, deadline=None, derandomize=True)
@given(prompt=st.text(alphabet=_ALPHABET, max_size=20), text=st.text(alphabet=_ALPHABET))
def test_deltas_concatenate_to_decode(name: str, prompt: str, text: str) -> None:
    tok = _TOKENIZERS[name]
    prompt_ids, ids = _encode(tok, prompt), _encode(tok, text)
    detok = IncrementalDetokenizer(tok, prompt_ids)
    deltas = _stream(detok, ids)
    assert all("\ufffd" not in d for d in deltas)
    # Valid text leaves nothing held back at the end.
    assert detok.flush() == ""
    # The continuation as decoding the whole sequence renders it (with
    # Metaspace, a generated word keeps the space the prompt context gives it).
    full, prompt_text = _oracle(tok, prompt_ids + ids), _oracle(tok, prompt_ids)
    assert full.startswith(prompt_text)
    assert "".join(deltas) == detok.text == full[len(prompt_text) :]
    if not prompt_ids and name == "byte_level":
        assert detok.text == text  # byte-level BPE round-trips any text


@pytest.mark.parametrize("name", TOKENIZER_NAMES)
def test_emoji_held_until_complete(name: str) -> None:
    tok = _TOKENIZERS[name]
    ids = _encode(tok, "hi 😀")
    detok = IncrementalDetokenizer(tok, [])
    deltas = _stream(detok, ids)
    assert deltas[-1].endswith("😀")
    assert sum("😀" in d for d in deltas) == 1
    assert all("\ufffd" not in d for d in deltas)


@pytest.mark.parametrize("name", TOKENIZER_NAMES)
def test_prompt_is_context_not_output(name: str) -> None:
    tok = _TOKENIZERS[name]
    ids = _encode(tok, "hello world")
    split = 1
    detok = IncrementalDetokenizer(tok, ids[:split])
    out = "".join(_stream(detok, ids[split:]))
    # The first generated token keeps its leading space thanks to the prompt
    # context (Metaspace would strip it if decoded alone).
    assert _oracle(tok, ids[:split]) + out == "hello world"


@pytest.mark.parametrize("name", TOKENIZER_NAMES)
def test_flush_emits_incomplete_character(name: str) -> None:
    tok = _TOKENIZERS[name]
    ids = _encode(tok, "ok 日本")[:-1]  # cut inside the last character
    detok = IncrementalDetokenizer(tok, [])
    deltas = _stream(detok, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == "ok 日"
    tail = detok.flush()
    # Replacement characters only: how many depends on the decoder (ByteFallback
    # replaces each byte of an invalid run, ByteLevel the maximal subpart).
    assert tail and set(tail) == {"\ufffd"}
    assert detok.text == "ok 日" + tail
    assert detok.flush() == ""


@pytest.mark.parametrize("name", TOKENIZER_NAMES)
def test_special_tokens_skipped_or_kept(name: str) -> None:
    tok = _TOKENIZERS[name]
    eos = tok.eos_token_id
    assert isinstance(eos, int)
    ids = _encode(tok, "ab 日") + [eos] + _encode(tok, " cd")
    skipping = IncrementalDetokenizer(tok, [])
    assert "".join(_stream(skipping, ids)) + skipping.flush() == _oracle(tok, ids)
    keeping = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    kept = "".join(_stream(keeping, ids)) + keeping.flush()
    assert kept == _oracle(tok, ids, skip=False)
    assert "</s>" in kept


@pytest.mark.parametrize("name", TOKENIZER_NAMES)
def test_decode_window_does_not_grow(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    tok = _TOKENIZERS[name]
    ids = _encode(tok, "the quick 日本語 fox 😀 jumps. " * 150)
    assert len(ids) > 2000
    sizes: list[int] = []
    real_decode = IncrementalDetokenizer._decode

    def spy(self: IncrementalDetokenizer, start: int, end: int) -> str:
        sizes.append(end - start)
        return real_decode(self, start, end)

    detok = IncrementalDetokenizer(tok, [])
    monkeypatch.setattr(IncrementalDetokenizer, "_decode", spy)
    out = "".join(_stream(detok, ids))
    monkeypatch.undo()
    assert out == _oracle(tok, ids)
    # Window = last emitted chunk + pending tokens: a few tokens, whatever the length.
    assert max(sizes) <= 12
