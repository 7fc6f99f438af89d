"""Small GGUF files written with the ``gguf`` package's writer, for tests.

``write_gguf`` does what llama.cpp's converter does to a Hugging Face Llama,
Qwen2 or Qwen3: renames tensors with llama.cpp's own name map (the ``gguf``
package's ``TensorNameMap``, not flotilla's table, so a wrong entry there
shows), permutes Q/K rows for Llama only, stores 2-D weights in one GGML type
(norms and biases stay F32) and writes the header and a GPT-2 style tokenizer
(the embedded byte-level vocabulary). Types the ``gguf`` package cannot
quantize (the K-quants) are filled with seeded random blocks whose fp16
scales are kept small: the test oracle is transformers' own load of the same
file (or ``dequantized_hf_model``), so any valid block content will do.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import (
    GGML_QUANT_SIZES,
    MODEL_ARCH,
    GGMLQuantizationType,
    GGUFReader,
    GGUFWriter,
    TensorNameMap,
    get_tensor_name_map,
    quants,
)
from transformers import LlamaConfig, PretrainedConfig, PreTrainedModel, Qwen2Config, Qwen3Config

from actors.load.embedded import CHAT_TEMPLATE, NUM_BYTES, build_tokenizer
from tests.actors.checkpoints import build_hf_model

T = GGMLQuantizationType
# (byte offset of an fp16 scale inside a block, its magnitude) for random blocks.
_RANDOM_BLOCK_SCALES: dict[GGMLQuantizationType, list[tuple[int, float]]] = {
    T.Q4_K: [(0, 4e-4), (2, 4e-4)],
    T.Q5_K: [(0, 2e-3), (2, 2e-3)],
    T.Q6_K: [(208, 6e-5)],
}


# Rows 256 and 512 wide fit every block size, K-quants included.
_SIZES: dict[str, object] = {
    "vocab_size": 512, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
    "bos_token_id": 256, "eos_token_id": 257, "pad_token_id": 258,
}
# Qwen's own defaults where they differ from Llama's (rope base, norm epsilon): a header key the loader
# misses changes the logits.
_QWEN: dict[str, object] = {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "rms_norm_eps": 1e-6}


def gguf_llama_config(**overrides: object) -> LlamaConfig:
    """A Llama whose rows fit every block size."""
    kw = {**_SIZES, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False}
    return LlamaConfig(**{**kw, **overrides})


def gguf_qwen2_config(**overrides: object) -> Qwen2Config:
    """A Qwen2 (q/k/v biases) with tied embeddings, as llama.cpp's Qwen2 files often are (no output.weight)."""
    return Qwen2Config(**{**_SIZES, **_QWEN, "tie_word_embeddings": True, **overrides})


def gguf_qwen3_config(**overrides: object) -> Qwen3Config:
    """A Qwen3 (per-head q/k norms) whose head_dim (32) is neither hidden / heads (64) nor Qwen3Config's
    default (128); its rows fit the 32-value blocks (Q8_0, Q4_0, Q4_1), not the K-quants."""
    return Qwen3Config(**{**_SIZES, **_QWEN, "head_dim": 32, "tie_word_embeddings": False, **overrides})


# llama.cpp's converter permutes Q/K rows for the LLaMA family only (LlamaModel.modify_tensors);
# Qwen2Model and Qwen3Model keep Hugging Face's rows.
PERMUTED_QK_FAMILIES = ("llama",)


def _permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's ``permute`` for Q/K rows (what the loader must undo)."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """The inverse of ``_permute``, written here rather than taken from the loader, which it checks."""
    return w.reshape(num_heads, w.shape[0] // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _name_map(config: PretrainedConfig) -> TensorNameMap:
    """llama.cpp's Hugging Face -> GGUF tensor names for ``config``'s family."""
    return get_tensor_name_map(MODEL_ARCH[str(config.model_type).upper()], int(config.num_hidden_layers))


def _qk_heads(config: PretrainedConfig, hf_name: str) -> int:
    """The heads llama.cpp permutes ``hf_name``'s rows over; 0 for a tensor (or family) it leaves alone."""
    if config.model_type not in PERMUTED_QK_FAMILIES:
        return 0
    if hf_name.endswith("q_proj.weight"):
        return int(config.num_attention_heads)
    return int(config.num_key_value_heads) if hf_name.endswith("k_proj.weight") else 0


def encode(w: np.ndarray, qtype: GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    """``w`` (float32, 2-D) stored as ``qtype``: quantized, or random blocks for K-quants."""
    if qtype == T.F32:
        return w
    if qtype in _RANDOM_BLOCK_SCALES:
        per, nbytes = GGML_QUANT_SIZES[qtype]
        n = w.size // per
        raw = rng.integers(0, 256, size=(n, nbytes), dtype=np.uint8)
        for offset, scale in _RANDOM_BLOCK_SCALES[qtype]:
            fp16 = (rng.uniform(0.5, 1.0, size=n) * scale).astype(np.float16)
            raw[:, offset : offset + 2] = fp16.view(np.uint8).reshape(n, 2)
        return raw.reshape(w.shape[0], -1)
    return quants.quantize(w, qtype)


VOCAB_NAMES = ("model.embed_tokens.weight", "lm_head.weight")


def write_gguf(path: Path, qtype: GGMLQuantizationType, *, config: PretrainedConfig | None = None,
               seed: int = 0, architecture: str | None = None, vocab_qtype: GGMLQuantizationType | None = None
               ) -> Path:
    """Write a seeded tiny model of ``config``'s family (default: ``gguf_llama_config()``) as a GGUF file with
    2-D weights in ``qtype`` (the embedding and LM head in ``vocab_qtype`` when given, as llama.cpp's Q4
    files keep them in Q8_0); returns ``path``. ``architecture`` overrides the header's architecture name
    only (the tensors stay the family's), to test refusals."""
    config = config or gguf_llama_config()
    state = build_hf_model(config, seed).state_dict()
    names = _name_map(config)
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), architecture or str(config.model_type))
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)  # as llama.cpp's converter does when config.json has a head_dim
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(head_dim)
    _add_tokenizer(writer)
    for name, tensor in state.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        w = tensor.detach().to(torch.float32).numpy()
        heads = _qk_heads(config, name)
        if heads:
            w = _permute(w, heads)
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, f"llama.cpp has no name for {name}"
        if w.ndim == 1:
            writer.add_tensor(gguf_name, w)
        else:
            kind = vocab_qtype if vocab_qtype is not None and name in VOCAB_NAMES else qtype
            data = encode(w, kind, rng)
            raw_dtype = None if kind == T.F32 else kind
            writer.add_tensor(gguf_name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def dequantized_hf_model(path: Path, config: PretrainedConfig) -> PreTrainedModel:
    """The transformers model of ``config`` holding the weights stored in ``path``: read and dequantized by
    the ``gguf`` package, named by llama.cpp's map, Q/K rows un-permuted (Llama) - no flotilla code."""
    model = build_hf_model(config, seed=0)
    expected = model.state_dict()
    names = _name_map(config)
    hf_names = {names.get_name(n, try_suffixes=(".weight", ".bias")): n for n in expected}
    state: dict[str, torch.Tensor] = {}
    for t in GGUFReader(path).tensors:
        name = hf_names[t.name]
        w = quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(expected[name].shape)
        heads = _qk_heads(config, name)
        state[name] = torch.from_numpy(_unpermute(w, heads) if heads else w.copy())
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True)
    return model.eval()


# A few byte-level merges (Ġ is the space byte), so the vocabulary is a real BPE.
MERGES = ["h e", "l l", "i n", "Ġ t", "t h", "e r", "Ġt he", "he ll", "a n", "o n"]


def test_vocabulary() -> tuple[list[str], list[int]]:
    """512 tokens: the 256 byte symbols, the embedded specials, the merged tokens, unused specials.

    Token types follow llama.cpp: 1 normal, 3 control.
    """
    base = sorted(build_tokenizer().get_vocab().items(), key=lambda kv: kv[1])
    specials = [t for t, i in base[NUM_BYTES:] if not t.startswith("<|unused_")]
    tokens = [t for t, _ in base[:NUM_BYTES]] + specials + [m.replace(" ", "") for m in MERGES]
    unused = [f"<|unused_{i}|>" for i in range(512 - len(tokens))]
    types = [1] * NUM_BYTES + [3] * len(specials) + [1] * len(MERGES) + [3] * len(unused)
    return tokens + unused, types


def _add_tokenizer(writer: GGUFWriter) -> None:
    tokens, types = test_vocabulary()
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(256)
    writer.add_eos_token_id(257)
    writer.add_pad_token_id(258)
    writer.add_chat_template(CHAT_TEMPLATE)
