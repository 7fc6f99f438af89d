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

from actors.load.embedded import build_tokenizer
from apps.llm import LLM
from scheduling.sampling_params import SamplingParams
from tests.actors.checkpoints import build_hf_model, hf_greedy, llama_config, write_checkpoint
from tests.actors.test_engine_oracle import MAX_TOKENS, MODES, PROMPTS
from tests.actors.test_spec_decode import assert_pages_free

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


def test_quantized_kv_stays_close_to_the_fp_model(model_dir: Path, references: dict[str, list[list[int]]]) -> None:
    hf = build_hf_model(llama_config(), 0)
    expected = [hf_greedy(hf, p, MAX_TOKENS) for p in PROMPTS]
    for kv in KV_DTYPES:
        same = sum(a == b for a, b in zip(references[kv], expected, strict=True))
        assert same >= 0.75 * len(PROMPTS), (kv, same)


@pytest.mark.parametrize("kv", KV_DTYPES)
@pytest.mark.parametrize("mode", [m for m in MODES if m != "batch_1"])
def test_scheduling_modes_do_not_change_tokens(
    model_dir: Path, references: dict[str, list[list[int]]], kv: str, mode: str
) -> None:
    llm = LLM(str(model_dir), **{**ENGINE, **MODES[mode]}, kv_cache_dtype=kv)
    assert llm.engine.executor.runner.pool.is_quantized  # type: ignore[attr-defined]
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert got == references[kv]
    stats = llm.engine.scheduler.stats
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
    assert llm.engine.scheduler.stats.spec_num_drafts > 0
    assert_pages_free(llm)
    llm.shutdown()
