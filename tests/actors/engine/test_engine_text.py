"""LLMEngine text at the end of a sequence: held-back bytes, stop tokens and stop strings.

A scripted executor emits chosen token ids, and the tokenizer has a token that
holds a whole character plus the first byte of the next one ("h" + the lead
byte of "é"), as real byte-level BPE vocabularies do: the detokenizer holds
such a token back until the character closes, so whatever ends the sequence
next must flush it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from actors.api import SequenceDelta
from actors.config import EngineConfig
from actors.engine.executor import Executor
from actors.engine.llm_engine import LLMEngine
from kvcache.kv_pool import KVCapacity
from scheduling.batch import Batch, StepOutput
from scheduling.errors import InvalidParameterError
from scheduling.sampling_params import SamplingParams

_BYTES = pre_tokenizers.ByteLevel.alphabet()  # the 256 byte-level characters
_H_LEAD = "h" + "é".encode().decode("latin-1")[0]  # "h" then é's first byte, as ByteLevel spells it
_NUM_PAGES = 16


def _tokenizer() -> PreTrainedTokenizerFast:
    vocab = {ch: i for i, ch in enumerate(sorted(_BYTES))}
    vocab[_H_LEAD] = len(vocab)
    vocab["<s>"], vocab["</s>"] = len(vocab), len(vocab) + 1
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[(_H_LEAD[0], _H_LEAD[1])]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   clean_up_tokenization_spaces=False)


class ScriptedExecutor(Executor):
    """Samples ``script[i]`` at the i-th sampling step (one request at a time)."""

    def __init__(self, model_path: Path, vocab_size: int, script: list[int]) -> None:
        self.model_path, self.vocab_size, self.script = model_path, vocab_size, list(script)
        self.capacity = KVCapacity(num_pages=_NUM_PAGES, num_tokens=_NUM_PAGES * 16, bytes=0,
                                   max_concurrent_seqs=4, page_size=16, max_model_len=64, max_num_seqs=4)

    def execute(self, batch: Batch) -> StepOutput:
        ids = [self.script.pop(0) for _ in batch.sample_indices]
        return StepOutput(ids, [None] * len(ids))

    def restart(self) -> None:
        """Nothing to rebuild."""

    def shutdown(self) -> None:
        """Nothing to release."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("text_tok")
    _tokenizer().save_pretrained(folder)
    return folder


def _run(model_dir: Path, script: list[int], params: SamplingParams) -> tuple[str, str | None]:
    """Generate one request to the end; return (its text, its finish reason)."""
    tok = _tokenizer()
    config = EngineConfig(model=str(model_dir), max_model_len=64, max_num_seqs=4,
                          max_num_batched_tokens=64, page_size=16, device="cpu")
    executor = ScriptedExecutor(model_dir, len(tok), script)
    engine = LLMEngine(config, executor)
    engine.add_request("r", tok.encode("ab"), params)
    deltas: list[SequenceDelta] = []
    while engine.has_unfinished:
        deltas += engine.step()
    assert not executor.script, "the script was not used up"
    cache = engine.policy.cache
    assert cache is not None and cache.num_locked_pages == 0
    cache.reset()
    assert engine.allocator.num_free_pages == _NUM_PAGES
    return "".join(d.text for d in deltas), deltas[-1].finish_reason


def _ids(*tokens: str) -> list[int]:
    tok = _tokenizer()
    ids = tok.convert_tokens_to_ids(list(tokens))
    assert isinstance(ids, list) and None not in ids and tok.unk_token_id not in ids
    return ids


def test_precondition_the_token_is_held_back() -> None:
    tok = _tokenizer()
    (h_lead,) = _ids(_H_LEAD)
    assert tok.decode([h_lead]) == "h\ufffd"
    assert tok.decode([h_lead, *_ids("©")]) == "hé"  # é = C3 A9; ByteLevel spells A9 "©"


def test_eos_flushes_the_held_back_character(model_dir: Path) -> None:
    tok = _tokenizer()
    (h_lead,) = _ids(_H_LEAD)
    text, reason = _run(model_dir, [h_lead, tok.eos_token_id], SamplingParams(max_tokens=10))
    # "h" was complete before EOS; the lone lead byte shows as U+FFFD, as a length end shows it.
    assert (text, reason) == ("h\ufffd", "stop")


def test_stop_token_id_flushes_held_text_but_adds_none_of_its_own(model_dir: Path) -> None:
    h_lead, newline = _ids(_H_LEAD, "Ċ")  # "Ċ" is ByteLevel's "\n"
    text, reason = _run(model_dir, [*_ids("x"), h_lead, newline],
                        SamplingParams(max_tokens=10, stop_token_ids=(newline,)))
    assert (text, reason) == ("xh\ufffd", "stop")


def test_a_stop_string_completed_by_the_eos_flush_still_cuts_the_text(model_dir: Path) -> None:
    tok = _tokenizer()
    (h_lead,) = _ids(_H_LEAD)
    text, reason = _run(model_dir, [*_ids("x"), h_lead, tok.eos_token_id],
                        SamplingParams(max_tokens=10, stop=("h",)))
    assert (text, reason) == ("x", "stop")


def test_a_stop_string_completed_by_the_final_flush_reports_stop(model_dir: Path) -> None:
    (x, h_lead) = _ids("x", _H_LEAD)
    # max_tokens ends the sequence on the held token; flushing it completes "h".
    text, reason = _run(model_dir, [x, h_lead], SamplingParams(max_tokens=2, stop=("h",)))
    assert (text, reason) == ("x", "stop")


def test_length_end_without_a_stop_string_still_flushes(model_dir: Path) -> None:
    (x, h_lead) = _ids("x", _H_LEAD)
    text, reason = _run(model_dir, [x, h_lead], SamplingParams(max_tokens=2, stop=("q",)))
    assert (text, reason) == ("xh\ufffd", "length")


def test_logit_bias_ids_past_the_vocabulary_are_refused_and_nothing_is_queued(model_dir: Path) -> None:
    tok = _tokenizer()
    config = EngineConfig(model=str(model_dir), max_model_len=64, max_num_seqs=4,
                          max_num_batched_tokens=64, page_size=16, device="cpu")
    engine = LLMEngine(config, ScriptedExecutor(model_dir, len(tok), []))
    with pytest.raises(InvalidParameterError) as info:
        engine.add_request("r", tok.encode("ab"), SamplingParams(logit_bias={len(tok): 1.0}))
    assert info.value.param == "logit_bias" and str(len(tok)) in str(info.value)
    assert not engine.has_unfinished
    engine.add_request("r", tok.encode("ab"), SamplingParams(logit_bias={len(tok) - 1: 1.0}))  # the last id is fine
    assert engine.has_unfinished
