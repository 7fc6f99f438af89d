"""GGUF files of llama.cpp's ``qwen2`` and ``qwen3`` architectures against transformers on the same weights.

Each file is a seeded tiny Hugging Face model written the way llama.cpp's
converter writes it (``tests.actors.gguf_files``: llama.cpp's own tensor
names, Q/K rows as Hugging Face has them, Qwen2 tied with q/k/v biases, Qwen3
with q/k norms and a head_dim that is not hidden / heads). The oracle is
transformers: on the checkpoint itself for F32, on the weights the ``gguf``
package dequantizes from the file for a quantized type.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedModel

from actors.load.gguf.convert import ensure_gguf_folder
from actors.load.gguf.reader import GGUFError
from actors.load.loader import load_model
from actors.models.layers import ParallelLinear
from apps.llm import LLM
from scheduling.sampling_params import SamplingParams
from tests.actors.checkpoints import build_hf_model, hf_greedy, hf_logits
from tests.actors.gguf_files import (
    T,
    dequantized_hf_model,
    gguf_qwen2_config,
    gguf_qwen3_config,
    write_gguf,
)
from tests.actors.int4_spy import record_int4_codes

FAMILIES: dict[str, Callable[..., PretrainedConfig]] = {"qwen2": gguf_qwen2_config, "qwen3": gguf_qwen3_config}
HF_ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
PROMPT = [256, 72, 101, 108, 108, 111, 263, 264, 9, 300, 40, 41, 42, 266, 267, 268]
MAX_TOKENS = 10
SEED = 7


@pytest.fixture
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A model cache of this test's own. The CPU kernels are switched off: their build cache lives in the
    same folder, and building them (minutes) belongs to the kernel tests; these test the weights."""
    monkeypatch.setenv("FLOTILLA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("FLOTILLA_CPU_KERNELS", "0")
    return tmp_path / "cache"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_f32_file_converts_to_the_hf_checkpoint(tmp_path: Path, family: str) -> None:
    """Every tensor (biases, q/k norms) exactly the checkpoint's, under its name; the header gives the config."""
    config = FAMILIES[family]()
    path = write_gguf(tmp_path / f"{family}.gguf", T.F32, config=config, seed=SEED)
    folder = ensure_gguf_folder(path, root=tmp_path / "cache")
    ours = load_file(str(folder / "model.safetensors"))
    theirs = build_hf_model(FAMILIES[family](), SEED).state_dict()
    if config.tie_word_embeddings:  # llama.cpp stores no output.weight: the head is the embedding
        del theirs["lm_head.weight"]
    assert set(ours) == set(theirs)
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name
    got = AutoConfig.from_pretrained(folder)
    assert got.architectures == [HF_ARCHITECTURES[family]] and got.model_type == family
    assert got.head_dim == (getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    assert got.tie_word_embeddings == config.tie_word_embeddings
    assert got.rope_parameters["rope_theta"] == config.rope_parameters["rope_theta"]
    assert got.rms_norm_eps == pytest.approx(config.rms_norm_eps)  # stored as float32 in the header


@pytest.mark.parametrize("qtype", [T.F32, T.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_llm_on_a_gguf_path_matches_transformers(private_cache: Path, family: str, qtype: T) -> None:
    """``LLM("/path/model.gguf")``: greedy tokens equal transformers', and the top-20 logprobs of every
    generated position are within 1e-4 of transformers' (fp32)."""
    config = FAMILIES[family]()
    path = write_gguf(private_cache.parent / f"{family}-{qtype.name}.gguf", qtype, config=config, seed=SEED)
    hf: PreTrainedModel = build_hf_model(FAMILIES[family](), SEED) if qtype == T.F32 else dequantized_hf_model(path, config)
    expected = hf_greedy(hf, PROMPT, MAX_TOKENS)
    ref = torch.log_softmax(hf_logits(hf, PROMPT + expected)[len(PROMPT) - 1 : -1], dim=-1)
    llm = LLM(str(path), max_model_len=64, num_kv_pages=32, dtype="float32", device="cpu")
    try:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=20)
        out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
        theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        text = "hello the world <|end|>"
        assert llm.tokenizer(text)["input_ids"] == theirs(text)["input_ids"]
    finally:
        llm.shutdown()
    assert out.token_ids == expected
    assert out.logprobs is not None and len(out.logprobs) == MAX_TOKENS
    for step, (lp, row) in enumerate(zip(out.logprobs, ref, strict=True)):
        top = torch.topk(row, 20)
        # The same 20 values (ties may order ids differently), each at the id transformers gives it.
        assert torch.allclose(torch.tensor(lp.top_logprobs), top.values, atol=1e-4), step
        assert torch.allclose(torch.tensor(lp.top_logprobs), row[lp.top_token_ids], atol=1e-4), step


@pytest.mark.parametrize("family", list(FAMILIES))
def test_q4_blocks_load_directly_without_a_qk_permutation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, family: str
) -> None:
    """``quantization="int4"`` on a Q4_1 file: every linear's codes are the file's blocks in Hugging Face
    row order (a Qwen file has no llama.cpp Q/K permutation to undo), i.e. exactly the float weights."""
    seen = record_int4_codes(monkeypatch)
    path = write_gguf(tmp_path / f"{family}-q4_1.gguf", T.Q4_1, config=FAMILIES[family](), seed=SEED,
                      vocab_qtype=T.Q8_0)
    folder = ensure_gguf_folder(path, root=tmp_path / "cache")
    kw: dict[str, Any] = {"dtype": torch.float32, "device": "cpu", "max_model_len": 64}
    ref = {n: m for n, m in load_model(str(folder), **kw).model.named_modules() if isinstance(m, ParallelLinear)}
    loaded = load_model(str(folder), quantization="int4", **kw)
    assert "14 linears from GGUF Q4 blocks" in loaded.weights
    got = {n: m for n, m in loaded.model.named_modules() if isinstance(m, ParallelLinear)}
    assert set(got) == set(ref)
    for name, layer in got.items():
        assert layer.quant is not None, name
        assert torch.equal(seen[id(layer.quant)].dequantize(), ref[name].weight), name


def test_unsupported_architecture_is_refused_by_name(private_cache: Path) -> None:
    path = write_gguf(private_cache.parent / "gemma3.gguf", T.F32, config=gguf_qwen3_config(), architecture="gemma3")
    with pytest.raises(GGUFError, match=r"GGUF architecture 'gemma3' is not supported; supported: llama, qwen2, qwen3") as err:
        LLM(str(path), max_model_len=64, dtype="float32", device="cpu")
    assert err.value.param == "model"
    assert not list(private_cache.glob("models/*"))  # nothing half-written


def test_a_tensor_the_architecture_lacks_is_named(tmp_path: Path) -> None:
    """llama.cpp's qwen3 has no attention biases: a file carrying them is refused, naming the tensor."""
    path = write_gguf(tmp_path / "qwen3-bias.gguf", T.F32, config=gguf_qwen3_config(attention_bias=True))
    with pytest.raises(GGUFError, match=r"tensor 'blk\.0\.attn_q\.bias' has no Qwen3 counterpart"):
        ensure_gguf_folder(path, root=tmp_path / "cache")
