"""Small GGUF files written with the ``gguf`` package's writer, for tests.

``write_llama_gguf`` does what llama.cpp's converter does to a Hugging Face
Llama: renames tensors, permutes Q/K rows, stores 2-D weights in one GGML
type (norms stay F32) and writes the header and a GPT-2 style tokenizer (the
embedded byte-level vocabulary). Types the ``gguf`` package cannot quantize
(the K-quants) are filled with seeded random blocks whose fp16 scales are
kept small: the test oracle is transformers' own load of the same file, so
any valid block content will do.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, quants
from transformers import LlamaConfig

from actors.load.embedded import CHAT_TEMPLATE, NUM_BYTES, build_tokenizer
from actors.load.gguf.convert import GGUF_GLOBAL_NAMES, GGUF_LAYER_NAMES
from tests.actors.checkpoints import build_hf_model

T = GGMLQuantizationType
# (byte offset of an fp16 scale inside a block, its magnitude) for random blocks.
_RANDOM_BLOCK_SCALES: dict[GGMLQuantizationType, list[tuple[int, float]]] = {
    T.Q4_K: [(0, 4e-4), (2, 4e-4)],
    T.Q5_K: [(0, 2e-3), (2, 2e-3)],
    T.Q6_K: [(208, 6e-5)],
}


def gguf_llama_config(**overrides: object) -> LlamaConfig:
    """A Llama whose rows (256 and 512 wide) fit every block size, K-quants included."""
    kw: dict[str, object] = {
        "vocab_size": 512, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "bos_token_id": 256, "eos_token_id": 257, "pad_token_id": 258,
    }
    return LlamaConfig(**{**kw, **overrides})


def _permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's ``permute`` for Q/K rows (what the loader must undo)."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


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


def _gguf_name(hf: str) -> str:
    inverse = {v: k for k, v in GGUF_GLOBAL_NAMES.items()}
    if hf in inverse:
        return inverse[hf]
    layer, rest = hf.removeprefix("model.layers.").split(".", 1)
    return f"blk.{layer}.{ {v: k for k, v in GGUF_LAYER_NAMES.items()}[rest] }"


def write_llama_gguf(path: Path, qtype: GGMLQuantizationType, *, config: LlamaConfig | None = None,
                     seed: int = 0, architecture: str = "llama", vocab_qtype: GGMLQuantizationType | None = None
                     ) -> Path:
    """Write a seeded tiny Llama as a GGUF file with 2-D weights in ``qtype`` (the embedding and
    LM head in ``vocab_qtype`` when given, as llama.cpp's Q4 files keep them in Q8_0); returns ``path``."""
    config = config or gguf_llama_config()
    state = build_hf_model(config, seed).state_dict()
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), architecture)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    _add_tokenizer(writer)
    for name, tensor in state.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        w = tensor.detach().to(torch.float32).numpy()
        if name.endswith("q_proj.weight"):
            w = _permute(w, config.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            w = _permute(w, config.num_key_value_heads)
        if w.ndim == 1:
            writer.add_tensor(_gguf_name(name), w)
        else:
            kind = vocab_qtype if vocab_qtype is not None and name in VOCAB_NAMES else qtype
            data = encode(w, kind, rng)
            raw_dtype = None if kind == T.F32 else kind
            writer.add_tensor(_gguf_name(name), data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


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
