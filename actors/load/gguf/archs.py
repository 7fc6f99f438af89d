"""The llama.cpp architectures flotilla converts: one table row each, and the tensor names they share.

llama.cpp names tensors ``blk.N.attn_q.weight`` and so on whatever the
architecture; an architecture only adds tensors (Qwen2's q/k/v biases,
Qwen3's per-head q/k RMS norms). Its converter (``convert_hf_to_gguf.py``)
permutes the Q/K rows of the LLaMA family only (``LlamaModel.modify_tensors``):
llama.cpp rotates LLaMA with adjacent pairs, so each head's two rotary halves
are interleaved; Qwen2 and Qwen3 use the NEOX rotation (halves, as Hugging
Face does), so their converters store the rows as they are.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from transformers import LlamaConfig, PretrainedConfig, Qwen2Config, Qwen3Config

from actors.load.gguf.reader import GGUFError, GGUFFile

# llama.cpp tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N."), every architecture.
GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_QWEN2_BIASES = {f"attn_{p}.bias": f"self_attn.{p}_proj.bias" for p in "qkv"}
_QWEN3_QK_NORMS = {f"attn_{p}_norm.weight": f"self_attn.{p}_norm.weight" for p in "qk"}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class GGUFArchitecture:
    """What one llama.cpp architecture converts to.

    ``layer_names``: its per-layer tensors (llama.cpp name after ``blk.N.`` ->
    Hugging Face name after ``model.layers.N.``); a tensor not in it (or in
    ``GGUF_GLOBAL_NAMES``) is refused. ``permuted_qk``: llama.cpp's converter
    interleaved the Q/K rows, which the loader undoes (``unpermute_rows``).
    """

    hf_architecture: str
    config_class: Callable[..., PretrainedConfig]  # a transformers config class, called with the header's fields
    layer_names: Mapping[str, str]
    permuted_qk: bool

    @property
    def family(self) -> str:
        """The family's name in messages: ``Llama``, ``Qwen2``, ``Qwen3``."""
        return self.hf_architecture.removesuffix("ForCausalLM")

    def hf_name(self, gguf_name: str) -> str:
        """The Hugging Face parameter name of a llama.cpp tensor; ``GGUFError`` for one this family lacks."""
        if gguf_name in GGUF_GLOBAL_NAMES:
            return GGUF_GLOBAL_NAMES[gguf_name]
        m = _LAYER_RE.match(gguf_name)
        if m and m.group(2) in self.layer_names:
            return f"model.layers.{m.group(1)}.{self.layer_names[m.group(2)]}"
        if gguf_name == "rope_freqs.weight":
            raise GGUFError("tensor 'rope_freqs.weight' (llama3-style rope scaling) is not supported in GGUF files")
        raise GGUFError(f"tensor {gguf_name!r} has no {self.family} counterpart; flotilla cannot load it")


# general.architecture -> its row.
ARCHITECTURES: dict[str, GGUFArchitecture] = {
    "llama": GGUFArchitecture("LlamaForCausalLM", LlamaConfig, GGUF_LAYER_NAMES, permuted_qk=True),
    "qwen2": GGUFArchitecture("Qwen2ForCausalLM", Qwen2Config, {**GGUF_LAYER_NAMES, **_QWEN2_BIASES},
                              permuted_qk=False),
    "qwen3": GGUFArchitecture("Qwen3ForCausalLM", Qwen3Config, {**GGUF_LAYER_NAMES, **_QWEN3_QK_NORMS},
                              permuted_qk=False),
}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(ARCHITECTURES)


def gguf_architecture(g: GGUFFile) -> GGUFArchitecture:
    """The row of ``g``'s ``general.architecture``; ``GGUFError`` naming it and the supported ones otherwise."""
    arch = g.architecture
    if arch not in ARCHITECTURES:
        raise GGUFError(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return ARCHITECTURES[arch]


def permuted_heads(hf_name: str, num_heads: int, num_kv_heads: int) -> int:
    """The head count a permuting converter (``permuted_qk``) interleaved ``hf_name``'s rows over; 0 if untouched."""
    if hf_name.endswith("self_attn.q_proj.weight"):
        return num_heads
    if hf_name.endswith("self_attn.k_proj.weight"):
        return num_kv_heads
    return 0


def unpermute_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (its converter interleaves each head's rotary halves).

    It moves whole rows, so it applies as well to per-row block data (int4
    codes, per-group scales) as to the dequantized weight.
    """
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
