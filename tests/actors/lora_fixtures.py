"""Seeded LoRA adapters and a Hugging Face PEFT oracle, for multi-LoRA tests.

Importable from any test folder (``from tests.actors.lora_fixtures import ...``).
``make_peft_adapter`` writes a real PEFT ``save_pretrained`` folder
(``adapter_config.json`` + ``adapter_model.safetensors``) for a Llama-architecture
base model; ``peft_greedy`` is the oracle: greedy tokens and top-k logprobs
from transformers + PEFT in float32 with eager attention.

PEFT initialises ``lora_B`` to zero, which makes a fresh adapter a no-op, so
every ``lora_A``/``lora_B`` weight is refilled with seeded normals times
``scale``. With the default ``scale`` an adapter changes greedy tokens of the
embedded ``tiny`` model within a few steps, yet logits stay finite.
"""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, PreTrainedModel

ATTENTION_PROJECTIONS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS: tuple[str, ...] = ("gate_proj", "up_proj", "down_proj")

PROJECTION_SETS: dict[str, tuple[str, ...]] = {
    "attention": ATTENTION_PROJECTIONS,
    "mlp": MLP_PROJECTIONS,
    "all": ATTENTION_PROJECTIONS + MLP_PROJECTIONS,
    "qv": ("q_proj", "v_proj"),
}

# Std of the seeded lora_A / lora_B entries. The delta (alpha / r) * B @ A @ x grows
# as scale**2 * sqrt(r * in_features) * alpha / r. On the embedded tiny model at
# r=8, alpha=16, 0.1 changes the first greedy token of most random prompts for
# every PROJECTION_SETS entry ("qv" within 3 tokens), moves logprobs by 1-7 nats
# and stays finite; 0.05 leaves some prompts unchanged over 16 tokens.
DEFAULT_LORA_SCALE = 0.1

# One greedy continuation: the token ids, and per generated position the
# top-k ``(token_id, logprob)`` pairs, best first.
GreedyResult = tuple[list[int], list[list[tuple[int, float]]]]


def load_base_model(base_dir: Path) -> PreTrainedModel:
    """The HF model at ``base_dir`` in float32 with eager attention, eval mode."""
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def make_peft_adapter(
    base_dir: Path,
    out_dir: Path,
    *,
    targets: tuple[str, ...],
    rank: int,
    alpha: float,
    seed: int,
    scale: float = DEFAULT_LORA_SCALE,
) -> Path:
    """``save_pretrained`` a PEFT LoRA adapter of ``base_dir`` into ``out_dir`` with seeded weights.

    Every ``lora_A``/``lora_B`` weight is ``scale * N(0, 1)`` from a generator
    seeded with ``seed`` (parameters filled in sorted name order, so the files
    depend only on the arguments). Returns ``out_dir``.
    """
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,  # type: ignore[arg-type]  # annotated int; PEFT accepts and saves a float
        target_modules=list(targets),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(load_base_model(base_dir), config)
    gen = torch.Generator().manual_seed(seed)
    lora = sorted((n, p) for n, p in model.named_parameters() if ".lora_A." in n or ".lora_B." in n)
    assert lora, f"no LoRA parameters for targets {targets}"
    with torch.no_grad():
        for _, p in lora:
            p.copy_(scale * torch.randn(p.shape, generator=gen))
    model.save_pretrained(str(out_dir), safe_serialization=True)
    assert (out_dir / "adapter_config.json").is_file() and (out_dir / "adapter_model.safetensors").is_file()
    return out_dir


def load_peft_model(base_dir: Path, adapter_dir: Path | None) -> PreTrainedModel:
    """The oracle model: base at ``base_dir`` (float32, eager) with the PEFT adapter at ``adapter_dir``.

    ``adapter_dir=None`` gives the bare base model. The adapter stays unmerged
    (base output + scaling * B @ A @ x, as PEFT computes it). Eval mode; load
    once and pass to ``greedy_topk`` for many prompts.
    """
    base = load_base_model(base_dir)
    if adapter_dir is None:
        return base
    return PeftModel.from_pretrained(base, adapter_dir, is_trainable=False).eval()  # type: ignore[return-value]


def greedy_topk(model: PreTrainedModel, prompt: list[int], max_tokens: int, top_k: int = 20) -> GreedyResult:
    """Greedy continuation of ``prompt`` (never stops at EOS) with top-k logprobs per position.

    Each step runs the whole sequence again (no KV cache: nothing to go stale,
    and no cache keyword that differs between transformers versions); the
    models this serves are tiny. Logprobs are ``log_softmax`` over the full
    vocabulary in float32.
    """
    tokens: list[int] = []
    tops: list[list[tuple[int, float]]] = []
    with torch.inference_mode():
        for _ in range(max_tokens):
            ids = torch.tensor([prompt + tokens])
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
            logprobs = torch.log_softmax(logits[0, -1].float(), dim=-1)
            values, indices = logprobs.topk(top_k)
            tokens.append(int(logprobs.argmax()))
            tops.append([(int(i), float(v)) for i, v in zip(indices, values, strict=True)])
    return tokens, tops


def peft_greedy(
    base_dir: Path, adapter_dir: Path | None, prompts: list[list[int]], max_tokens: int, top_k: int = 20
) -> list[GreedyResult]:
    """Greedy tokens and top-k logprobs of each prompt under base + adapter (``None``: bare base)."""
    model = load_peft_model(base_dir, adapter_dir)
    return [greedy_topk(model, prompt, max_tokens, top_k) for prompt in prompts]
