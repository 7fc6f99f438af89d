"""The embedded default models: deterministic Llama-architecture models made on first use.

``tiny`` (~3.4M parameters) and ``small`` (~100M) need no download: their
weights come from seeded generators (one seed per parameter, derived from the
model and parameter names), so every machine builds identical files. They are
written as standard Hugging Face folders (safetensors, config, byte-level
tokenizer with a chat template) under ``$FLOTILLA_CACHE_DIR/models``.

Vocabulary (512 ids): 0..255 are the bytes (token id == byte value), then the
special tokens below, then reserved ``<|unused_N|>`` specials up to 512.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from actors.load.model_cache import build_once, models_dir, update_json
from actors.tokenizing import bytes_to_unicode

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

EMBEDDED_MODELS: tuple[str, ...] = ("tiny", "small")

VOCAB_SIZE = 512
NUM_BYTES = 256
SPECIAL_TOKENS: tuple[str, ...] = ("<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
BOS_ID, EOS_ID, PAD_ID = 256, 257, 258
END_ID = 262  # <|end|> closes every chat turn, so generation also stops there.

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "{{ '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

# Bump when anything about how the files are generated changes: it is part of
# the folder name, so old caches are never reused for a new recipe.
_RECIPE_VERSION = 1


@dataclass(frozen=True)
class EmbeddedSpec:
    """Architecture numbers of one embedded model (all Llama, untied head)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_position_embeddings: int
    torch_dtype: str

    def num_parameters(self) -> int:
        """Exact parameter count (embedding + head + layers + final norm)."""
        h, head_dim = self.hidden_size, self.hidden_size // self.num_heads
        attn = 2 * h * h + 2 * h * self.num_kv_heads * head_dim
        layer = attn + 3 * h * self.intermediate_size + 2 * h
        return 2 * VOCAB_SIZE * h + self.num_layers * layer + h


SPECS: dict[str, EmbeddedSpec] = {
    "tiny": EmbeddedSpec(256, 4, 8, 4, 768, 4096, "float32"),
    "small": EmbeddedSpec(1024, 8, 16, 8, 3072, 4096, "bfloat16"),
}


def _spec_of(name: str) -> EmbeddedSpec:
    if name not in SPECS:
        from scheduling.errors import InvalidParameterError

        raise InvalidParameterError("model", f"unknown embedded model {name!r}; embedded models: {', '.join(SPECS)}")
    return SPECS[name]


def spec_hash(name: str) -> str:
    """Short hash of everything that determines the files of ``name``."""
    blob = json.dumps({"name": name, "spec": asdict(_spec_of(name)), "recipe": _RECIPE_VERSION}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def hf_config_dict(name: str) -> dict[str, object]:
    """The ``LlamaConfig`` keyword arguments of ``name``."""
    spec = _spec_of(name)
    return {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
    }


def _seeded_normal(shape: tuple[int, ...], std: float, seed_key: str) -> torch.Tensor:
    seed = int.from_bytes(hashlib.sha256(seed_key.encode()).digest()[:8], "little") & (2**63 - 1)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float32) * std


def make_state_dict(name: str, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """Deterministic weights for HF parameter ``shapes``: ones for norms, seeded normals else.

    Embeddings get std 1 so token identity survives in the residual stream, and
    the head ``2/sqrt(hidden)`` so logits spread (std ~2) rather than sit near-uniform.
    """
    hidden = _spec_of(name).hidden_size
    out: dict[str, torch.Tensor] = {}
    for pname, shape in shapes.items():
        if pname.endswith("norm.weight"):
            out[pname] = torch.ones(shape)
            continue
        std = 1.0 if "embed_tokens" in pname else 2.0 / hidden**0.5 if pname.startswith("lm_head") else 0.02
        out[pname] = _seeded_normal(shape, std, f"flotilla/{name}/{pname}")
    return out


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The byte-level tokenizer (a transformers ``PreTrainedTokenizerFast``)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = bytes_to_unicode()
    # A BPE without merges over the 256 byte symbols: every byte is one token.
    bpe = models.BPE(vocab={alphabet[b]: b for b in range(NUM_BYTES)}, merges=[])
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    unused = [f"<|unused_{i}|>" for i in range(VOCAB_SIZE - NUM_BYTES - len(SPECIAL_TOKENS))]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (*SPECIAL_TOKENS, *unused)])
    assert tok.get_vocab_size() == VOCAB_SIZE and tok.token_to_id("<|end|>") == END_ID
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
    )


def _write_model(name: str, folder: Path) -> None:
    from transformers import GenerationConfig, LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    spec = _spec_of(name)
    config = LlamaConfig(**hf_config_dict(name))  # type: ignore[arg-type]
    config.architectures = ["LlamaForCausalLM"]
    with torch.device("meta"):
        model = HFLlama(config)
    shapes = {n: tuple(p.shape) for n, p in model.state_dict().items()}
    dtype = getattr(torch, spec.torch_dtype)
    state = {k: v.to(dtype) for k, v in make_state_dict(name, shapes).items()}
    model.load_state_dict(state, strict=True, assign=True)
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=[EOS_ID, END_ID], pad_token_id=PAD_ID
    )
    model.save_pretrained(folder, safe_serialization=True)
    build_tokenizer().save_pretrained(folder)
    # Readers on transformers 4 (e.g. a vLLM peer) look for these older keys.
    update_json(folder / "config.json", {"rope_theta": 10000.0})
    update_json(
        folder / "tokenizer_config.json",
        {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE},
    )


def ensure_embedded_model(name: str, *, root: Path | None = None) -> Path:
    """Return the folder of embedded model ``name``, building it on first use.

    ``root`` overrides the cache folder (default ``cache_dir()``); concurrent
    callers are safe (``model_cache.build_once``).
    """
    _spec_of(name)
    return build_once(models_dir(root) / f"{name}-{spec_hash(name)}", lambda tmp: _write_model(name, tmp))
