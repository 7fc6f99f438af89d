"""Gemma 3 (text): sandwich norms with ``(1 + w)`` weights, q/k norms, GeGLU, scaled embeddings, and
sliding-window layers (``sliding_attention`` in ``layer_types``) with their own RoPE base among global ones."""

from __future__ import annotations

from actors.models.decoder import CausalLM
from actors.models.decoder_args import (
    DecoderArgs,
    HFConfig,
    as_pretrained,
    common_args,
    config_get,
    refuse,
    rope_from,
)


class Gemma3ForCausalLM(CausalLM):
    """Gemma 3's language model (``Gemma3ForCausalLM``, ``model_type`` ``gemma3_text``).

    Refused by name: attention logit soft-capping (Gemma 2's, not Gemma 3's),
    bidirectional attention (EmbeddingGemma), activations other than tanh-GELU.
    The multimodal ``Gemma3ForConditionalGeneration`` is not a registered architecture.
    """

    family = "Gemma 3"

    @classmethod
    def parse_args(cls, config: HFConfig) -> DecoderArgs:
        # transformers derives layer_types and the per-kind rope_parameters from older fields.
        cfg = as_pretrained(config)
        g = config_get
        act = g(cfg, "hidden_activation", None) or g(cfg, "hidden_act", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise refuse(f"hidden_activation {act!r}", cls.family, "gelu_pytorch_tanh")
        if g(cfg, "attn_logit_softcapping", None) is not None:
            raise refuse("attn_logit_softcapping", cls.family, "final_logit_softcapping only")
        if g(cfg, "use_bidirectional_attention", False):
            raise refuse("use_bidirectional_attention", cls.family, "causal attention")
        ropes = g(cfg, "rope_parameters", None) or {}
        softcap = g(cfg, "final_logit_softcapping", None)
        return common_args(
            cfg,
            cls.family,
            act="gelu_tanh",
            norm="gemma",
            qk_norm=True,
            sandwich_norms=True,
            embed_scale=float(g(cfg, "hidden_size")) ** 0.5,
            attn_scale=float(g(cfg, "query_pre_attn_scalar")) ** -0.5,
            rope=rope_from(ropes.get("full_attention"), 1_000_000.0),
            local_rope=rope_from(ropes.get("sliding_attention"), 10_000.0),
            final_logit_softcap=None if softcap is None else float(softcap),
            tie_word_embeddings=bool(g(cfg, "tie_word_embeddings", True)),
        )
