"""The engine on quantized KV pages: every scheduling mode, aborts, the start-up report.

Quantized K/V change the numbers a little, so the reference is the same
engine and kv_cache_dtype at batch 1 with no prefix cache; the scheduling
modes (prefix reuse, chunked prefill, preemption) must not change a token of
it. Every test ends with every page free.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from actors.load.embedded import build_tokenizer
from apps.llm import LLM
from scheduling.sampling_params import SamplingParams
from tests.actors.checkpoints import build_hf_model, llama_config, write_checkpoint
from tests.actors.engine.test_engine_oracle import MAX_TOKENS, MODES, PROMPTS
from tests.actors.engine.test_spec_decode import assert_pages_free

KV_DTYPES = ("int8", "fp8")
ENGINE: dict[str, Any] = {"max_model_len": 128, "max_num_seqs": 16, "max_num_batched_tokens": 512,
                          "dtype": "float32", "device": "cpu"}
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = write_checkpoint(tmp_path_factory.mktemp("kvq"), llama_config(), seed=0)
    build_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def references(model_dir: Path) -> dict[str, list[list[int]]]:
    """Per kv dtype: batch-1 greedy outputs without the prefix cache."""
    out = {}
    for kv in KV_DTYPES:
        llm = LLM(str(model_dir), **{**ENGINE, "max_num_seqs": 1, "enable_prefix_caching": False},
                  kv_cache_dtype=kv)
        out[kv] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        assert_pages_free(llm)
        llm.shutdown()
    return out


# A quantized K or V element is off by at most half a step of its vector's scale: 1/254 of the vector's largest
# element for int8 (127 levels a side), 2^-4 relative for fp8 e4m3 (3 mantissa bits). The attention output, a
# softmax-weighted mean of V over scores of K, and so this model's O(1) logits move by about that fraction, so
# a greedy pick may differ from the fp model's only where the fp model's top two logits are that close.
# (Measured on this model: picks within 0.0015 of the fp best for int8 and 0.025 for fp8.)
NEAR_TIE = {"int8": 1 / 254, "fp8": 2**-4}


def test_quantized_kv_picks_only_what_the_fp_model_nearly_ties(
    model_dir: Path, references: dict[str, list[list[int]]]
) -> None:
    """Teacher-forced on each quantized run's own tokens, the fp model scores every picked token within
    ``NEAR_TIE`` of its best: a run on wrong pages (a bad scale, a stale page) picks tokens far below it."""
    hf = build_hf_model(llama_config(), 0)
    for kv in KV_DTYPES:
        for prompt, tokens in zip(PROMPTS, references[kv], strict=True):
            with torch.inference_mode():
                logits = hf(torch.tensor([prompt + list(tokens)])).logits[0, len(prompt) - 1 : -1]
            gap = logits.max(-1).values - logits[torch.arange(len(tokens)), torch.tensor(list(tokens))]
            assert float(gap.max()) <= NEAR_TIE[kv], (kv, prompt, gap.tolist())


@pytest.mark.parametrize("kv", KV_DTYPES)
@pytest.mark.parametrize("mode", [m for m in MODES if m != "batch_1"])
def test_scheduling_modes_do_not_change_tokens(
    model_dir: Path, references: dict[str, list[list[int]]], kv: str, mode: str
) -> None:
    llm = LLM(str(model_dir), **{**ENGINE, **MODES[mode]}, kv_cache_dtype=kv)
    assert llm.engine.executor.runner.pool.is_quantized  # type: ignore[attr-defined]
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert got == references[kv]
    stats = llm.engine.policy.stats
    if mode == "preemption":
        assert stats.num_preemptions > 0
    if mode == "prefix_on":
        again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == references[kv]
        assert sum(o.num_cached_tokens for o in again) > 0
    assert_pages_free(llm)
    llm.shutdown()


@pytest.mark.parametrize("kv", KV_DTYPES)
def test_abort_mid_generation_frees_every_page(model_dir: Path, kv: str) -> None:
    llm = LLM(str(model_dir), **ENGINE, num_kv_pages=48, page_size=4, kv_cache_dtype=kv)
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    for _ in range(6):
        engine.step()
    assert engine.has_unfinished
    for i in range(len(PROMPTS)):
        engine.abort(f"r{i}")
    assert_pages_free(llm)
    llm.shutdown()


def test_the_start_up_report_names_the_kv_dtype(model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO"):
        llm = LLM(str(model_dir), **ENGINE, num_kv_pages=64, kv_cache_dtype="int8")
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache"))
    pool = llm.engine.executor.runner.pool  # type: ignore[attr-defined]
    assert "int8 + bf16 scales per token and head" in line
    assert f"{pool.total_bytes / 2**20:.1f} MiB" in line
    llm.shutdown()


@pytest.mark.parametrize("kv", KV_DTYPES)
def test_speculative_decoding_on_quantized_pages_keeps_the_tokens(
    model_dir: Path, references: dict[str, list[list[int]]], kv: str
) -> None:
    spec = {"method": "draft", "layers": 1, "num_speculative_tokens": 3, "min_acceptance": 0.0}
    llm = LLM(str(model_dir), **ENGINE, kv_cache_dtype=kv, speculative_config=spec)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert got == references[kv]
    assert llm.engine.policy.stats.spec_num_drafts > 0
    assert_pages_free(llm)
    llm.shutdown()
