"""The 2026 families (Qwen3, Qwen3-MoE, Qwen2-MoE, Mixtral, Gemma 3, Phi-3) against transformers.

Each family is a seeded tiny checkpoint with every feature it has switched on
(``tests.actors.checkpoints.FAMILY_CONFIGS``: GQA, q/k norms, a sliding
window shorter than most prompts, 8 experts with top-2 routing, a shared
expert, Gemma's sandwich norms, local RoPE base and soft cap, Phi-3's fused
checkpoint tensors). Greedy tokens must equal HF ``generate``'s in each of the
engine oracle's five scheduling modes, and the top-20 logprobs of every
generated position must be within 1e-4 of HF's (fp32).

A prompt whose HF path meets a routing near-tie (two experts' router
probabilities within ``ROUTER_TIE``, which fp32 rounding decides) is left
out of the greedy comparison: past it, either expert is correct and the
tokens may part (a Qwen2-MoE prompt here has a gap of 3e-8 in its first
layer, and the engine picks the other expert). At most two prompts may be
left out, so the comparison cannot empty itself.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import PreTrainedModel

from actors.api import RequestOutput
from actors.load.embedded import build_tokenizer
from actors.models.registry import (
    SUPPORTED_ARCHITECTURES,
    UnsupportedModelError,
    resolve_architecture,
)
from apps.llm import LLM
from scheduling.errors import InvalidParameterError
from scheduling.sampling_params import SamplingParams
from tests.actors.checkpoints import (
    FAMILY_CONFIGS,
    WINDOW,
    build_hf_model,
    gemma3_config,
    hf_greedy,
    qwen3_moe_config,
    router_near_tie,
    write_checkpoint,
)
from tests.actors.engine.test_engine_oracle import (
    BACKENDS,
    MODES,
    PROMPTS,
    assert_backend,
    assert_pool_clean,
)

MAX_TOKENS = 12
# Most oracle prompts are longer than the window: windows really cut.
assert sum(len(p) > WINDOW for p in PROMPTS) >= 10


# A family's name, its checkpoint, the HF oracle, HF's greedy tokens per prompt, and the prompts compared
# (those whose HF path has no routing near-tie).
Family = tuple[str, Path, PreTrainedModel, list[list[int]], list[int]]


@pytest.fixture(scope="module", params=list(FAMILY_CONFIGS))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Family:
    name: str = request.param
    make = FAMILY_CONFIGS[name]
    folder = write_checkpoint(tmp_path_factory.mktemp(name), make(), seed=3)
    build_tokenizer().save_pretrained(folder)
    hf = build_hf_model(make(), 3)
    expected = [hf_greedy(hf, p, MAX_TOKENS) for p in PROMPTS]
    compared = [i for i, (p, e) in enumerate(zip(PROMPTS, expected, strict=True)) if not router_near_tie(hf, p + e)]
    assert len(compared) >= len(PROMPTS) - 2, f"{name}: routing near-ties on {len(PROMPTS) - len(compared)} prompts"
    return name, folder, hf, expected, compared


def _greedy(outs: list[RequestOutput], compared: list[int]) -> list[list[int]]:
    return [outs[i].outputs[0].token_ids for i in compared]


def _engine(folder: Path, **overrides: Any) -> LLM:
    kw: dict[str, Any] = {"max_model_len": 128, "max_num_seqs": 16, "max_num_batched_tokens": 512,
                          "dtype": "float32", "device": "cpu"}
    return LLM(str(folder), **{**kw, **overrides})


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_matches_hf_in_every_mode(family: Family, mode: str) -> None:
    _, folder, _, expected, compared = family
    want = [expected[i] for i in compared]
    llm = _engine(folder, **MODES[mode])
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert _greedy(outs, compared) == want
    if mode == "preemption":
        assert llm.engine.policy.stats.num_preemptions > 0
    if mode == "prefix_on":
        again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert _greedy(again, compared) == want
        assert sum(o.num_cached_tokens for o in again) > 0
    assert_pool_clean(llm)


@pytest.mark.parametrize("backend", ["flashinfer_emulator", "flashinfer_static_decode"])
def test_flashinfer_backend_matches_hf(family: Family, backend: str) -> None:
    """Windows through FlashInfer's ``window_left`` (the tests' CPU emulator of its kernels), with chunked prefill."""
    _, folder, _, expected, compared = family
    llm = _engine(folder, **MODES["chunked_small_budget"], **BACKENDS[backend])
    assert_backend(llm, backend)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert _greedy(outs, compared) == [expected[i] for i in compared]
    assert_pool_clean(llm)


def test_top20_logprobs_match_hf(family: Family) -> None:
    """Every generated position (prefill's last row, then decodes past the window) within 1e-4 of HF."""
    _, folder, hf, _, _ = family
    llm = _engine(folder)
    prompts = [p for p in PROMPTS if len(p) > WINDOW][:4]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=20)
    worst = 0.0
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False), strict=True):
        tokens = out.outputs[0].token_ids
        with torch.inference_mode():
            ref = torch.log_softmax(hf(torch.tensor([prompt + tokens])).logits[0].float(), dim=-1)
        lps = out.outputs[0].logprobs
        assert lps is not None and len(lps) == len(tokens)
        for i, lp in enumerate(lps):
            row = ref[len(prompt) - 1 + i]
            top = torch.topk(row, 20)
            assert lp.top_token_ids == top.indices.tolist()
            worst = max(worst, float((torch.tensor(lp.top_logprobs) - top.values).abs().max()))
    assert worst <= 1e-4, worst
    assert_pool_clean(llm)


def test_gemma3_prompt_longer_than_its_window_through_the_prefix_cache(tmp_path: Path) -> None:
    """A 100-token conversation (window 24) reused through the prefix cache: equal to HF both times."""
    folder = write_checkpoint(tmp_path / "gemma3", gemma3_config(), seed=5)
    build_tokenizer().save_pretrained(folder)
    hf = build_hf_model(gemma3_config(), 5)
    rng = random.Random(3)
    history = [rng.randrange(3, 256) for _ in range(100)]
    follow_ups = [history + [rng.randrange(3, 256) for _ in range(n)] for n in (1, 9, 17)]
    llm = _engine(folder, page_size=8, max_model_len=160)
    assert llm.generate([history], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == hf_greedy(hf, history, MAX_TOKENS)
    outs = llm.generate(follow_ups, GREEDY, use_tqdm=False)
    for prompt, out in zip(follow_ups, outs, strict=True):
        assert out.num_cached_tokens >= 96  # the whole history's pages, far past the window
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, MAX_TOKENS)
    assert_pool_clean(llm)


def test_expert_parallel_is_refused_for_a_dense_model(tmp_path: Path) -> None:
    folder = write_checkpoint(tmp_path / "qwen3", FAMILY_CONFIGS["qwen3"](), seed=1)
    build_tokenizer().save_pretrained(folder)
    with pytest.raises(InvalidParameterError, match="expert_parallel needs an MoE model") as err:
        _engine(folder, expert_parallel=True)
    assert err.value.param == "expert_parallel"


def test_moe_models_refuse_weight_quantization(tmp_path: Path) -> None:
    folder = write_checkpoint(tmp_path / "moe", qwen3_moe_config(), seed=1)
    build_tokenizer().save_pretrained(folder)
    with pytest.raises(InvalidParameterError, match="mixture-of-experts") as err:
        _engine(folder, quantization="int8")
    assert err.value.param == "quantization"


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}, "DeepseekV3ForCausalLM"),
        ({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3"}, "Gemma3ForConditionalGeneration"),
        ({"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss"}, "GptOssForCausalLM"),
    ],
)
def test_unsupported_architectures_are_refused_with_the_supported_list(config: dict[str, Any], match: str) -> None:
    with pytest.raises(UnsupportedModelError, match=match) as err:
        resolve_architecture(config)
    for name in SUPPORTED_ARCHITECTURES:
        assert name in str(err.value)
    for family_arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM", "Gemma3ForCausalLM",
                        "Phi3ForCausalLM", "Qwen2MoeForCausalLM"):
        assert family_arch in SUPPORTED_ARCHITECTURES


@pytest.mark.parametrize(
    ("make", "overrides", "match"),
    [
        (gemma3_config, {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping.*supported"),
        (gemma3_config, {"hidden_activation": "relu"}, "hidden_activation 'relu'.*gelu_pytorch_tanh"),
        (FAMILY_CONFIGS["phi3"], {"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0] * 8,
                                                      "long_factor": [1.0] * 8, "rope_theta": 1e4}},
         "'longrope'.*supported.*llama3"),
        (FAMILY_CONFIGS["phi3"], {"partial_rotary_factor": 0.5}, "partial rotary"),
        (FAMILY_CONFIGS["qwen3"], {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}},
         "'yarn'.*supported"),
    ],
)
def test_unimplemented_config_features_are_refused_by_name(
    tmp_path: Path, make: Any, overrides: dict[str, Any], match: str
) -> None:
    folder = write_checkpoint(tmp_path / "m", make(), seed=1)
    build_tokenizer().save_pretrained(folder)
    config_file = folder / "config.json"
    raw = {**json.loads(config_file.read_text()), **overrides}
    config_file.write_text(json.dumps(raw))
    with pytest.raises(InvalidParameterError, match=match) as err:
        _engine(folder)
    assert err.value.param == "model"
