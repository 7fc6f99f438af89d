"""LoRA on the 2026 dense families (Qwen3, Gemma 3, Phi-3) against PEFT on transformers.

``tests/actors/engine/test_lora.py`` checks every projection set on the Llama
architecture; the families add what a Llama adapter never meets: Qwen3's
q/k norms and projection biases, Gemma 3's sandwich norms, scaled softmax and
logit soft cap, and Phi-3's fused ``qkv_proj`` / ``gate_up_proj`` checkpoint
modules, which a Phi-3 adapter targets by those fused names. Each family is a
seeded tiny checkpoint (``tests.actors.checkpoints``); the oracle is PEFT's
unmerged forward in float32 (``tests.actors.lora_fixtures``): greedy tokens
equal, top-20 logprobs within ``TOLERANCE``, and the adapter must move the
logprobs away from the base model's so that the comparison cannot pass on
an adapter the engine ignored.
"""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest

from actors.load.embedded import build_tokenizer
from apps.llm import LLM
from scheduling.sampling_params import SamplingParams
from tests.actors.checkpoints import FAMILY_CONFIGS, write_checkpoint
from tests.actors.engine.test_engine_oracle import assert_pool_clean
from tests.actors.engine.test_lora import TOLERANCE, assert_matches_peft
from tests.actors.lora_fixtures import (
    ATTENTION_PROJECTIONS,
    MLP_PROJECTIONS,
    GreedyResult,
    make_peft_adapter,
    peft_greedy,
)

MAX_TOKENS = 6
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=20)
# The modules a PEFT adapter names on each family: Phi-3's checkpoint fuses q/k/v and gate/up.
FAMILY_TARGETS: dict[str, tuple[str, ...]] = {
    "qwen3": ATTENTION_PROJECTIONS + MLP_PROJECTIONS,
    "gemma3": ATTENTION_PROJECTIONS + MLP_PROJECTIONS,
    "phi3": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
}
# Gemma 3's norms after each block and its soft cap damp a delta: a larger seeded adapter shows.
SCALES = {"qwen3": 0.1, "gemma3": 0.3, "phi3": 0.1}


def _prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(rng.randint(4, 40))] for _ in range(n)]


def _max_logprob_shift(adapted: list[GreedyResult], base: list[GreedyResult]) -> float:
    """The largest change the adapter makes to a first-position top-20 logprob shared with the base."""
    shift = 0.0
    for (_, tops_a), (_, tops_b) in zip(adapted, base, strict=True):
        b = dict(tops_b[0])
        shift = max([shift, *(abs(v - b[t]) for t, v in tops_a[0] if t in b)])
    return shift


@pytest.mark.parametrize("name", list(FAMILY_TARGETS))
def test_family_adapters_match_peft(name: str, tmp_path: Path) -> None:
    folder = write_checkpoint(tmp_path / name, FAMILY_CONFIGS[name](), seed=3)
    build_tokenizer().save_pretrained(folder)
    adapter = make_peft_adapter(folder, tmp_path / f"{name}-lora", targets=FAMILY_TARGETS[name], rank=8, alpha=16,
                                seed=1, scale=SCALES[name])  # fmt: skip
    prompts = _prompts(0, 3)
    expected = peft_greedy(folder, adapter, prompts, MAX_TOKENS)
    base = peft_greedy(folder, None, prompts, MAX_TOKENS)
    assert _max_logprob_shift(expected, base) > 100 * TOLERANCE  # the adapter shows in what is compared
    llm = LLM(str(folder), max_model_len=256, max_num_seqs=8, dtype="float32", device="cpu", enable_lora=True,
              max_lora_rank=16)  # fmt: skip
    llm.load_lora("task", str(adapter))
    # The adapted and the base requests in one batch: each gets its own oracle's answer.
    params = [replace(GREEDY, lora=lora) for lora in ("task", None) for _ in prompts]
    outs = llm.generate(prompts * 2, params, use_tqdm=False)
    assert_matches_peft(outs[: len(prompts)], expected)
    assert_matches_peft(outs[len(prompts) :], base)
    assert_pool_clean(llm)
