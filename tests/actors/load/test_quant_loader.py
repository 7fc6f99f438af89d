"""``load_model(quantization=...)`` from float checkpoints: what is quantized, memory, logits, errors.

The logits reference is the float model with every quantized weight replaced
by its dequantized value, so the only difference left is the bfloat16
rounding of activations inside the quantized linears (and of the int8 head's
output): within 2% of the logits' scale (measured 0.3-0.9%).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from actors.load.loader import load_model
from actors.models.layers import ParallelLinear
from actors.models.llama import LlamaForCausalLM
from actors.models.quant_linear import Int4Linear, Int8Linear
from scheduling.errors import InvalidParameterError
from tests.actors.checkpoints import new_dense, step_logits

PROMPT = [1, 17, 300, 4, 4, 99, 511, 256, 3, 0]
KW: dict[str, Any] = {"dtype": torch.float32, "device": "cpu", "max_model_len": 64}


def _kernel_weight(quant: Int8Linear | Int4Linear) -> torch.Tensor:
    if isinstance(quant, Int8Linear):
        return quant.dequantize()
    return quant(torch.eye(quant.in_features)).t().float()  # one-hot rows: the int4 weight in bfloat16


def _dequantized_copy(folder: Path, quantized: LlamaForCausalLM) -> LlamaForCausalLM:
    ref = load_model(str(folder), **KW).model
    mods = dict(quantized.named_modules())
    with torch.no_grad():
        for name, layer in ref.named_modules():
            if isinstance(layer, ParallelLinear):
                quant = mods[name].quant
                assert quant is not None, name
                layer.weight.copy_(_kernel_weight(quant))
        head = quantized.lm_head.quant
        assert head is not None
        ref.lm_head.weight.copy_(head.dequantize())  # tied: the embedding too
    return ref


def _logits(model: LlamaForCausalLM) -> torch.Tensor:
    return step_logits(model, new_dense(model), [(0, PROMPT, 0)])[0]


@pytest.mark.parametrize(("quantization", "group_size"), [("int8", None), ("int4", 32), ("int4", 64)])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_quantized_model_matches_its_dequantized_weights(
    checkpoint_dirs: dict[str, Path], arch: str, quantization: str, group_size: int | None
) -> None:
    folder = checkpoint_dirs[arch]
    plain = load_model(str(folder), **KW)
    loaded = load_model(str(folder), quantization=quantization, quantization_group_size=group_size,
                        **KW)
    model = loaded.model
    for name, layer in model.named_modules():
        if isinstance(layer, ParallelLinear):
            assert layer.weight.numel() == 0 and not layer.pack_for_cpu(), name
            assert isinstance(layer.quant, Int8Linear if quantization == "int8" else Int4Linear), name
    assert isinstance(model.lm_head.quant, Int8Linear)  # int8 with either method
    tied = model.args.tie_word_embeddings
    assert (model.model.embed_tokens.quant is model.lm_head.quant) == tied
    assert loaded.weight_bytes < plain.weight_bytes / 2  # an untied float embedding stays
    want = _logits(_dequantized_copy(folder, model))
    got = _logits(model)
    assert (got - want).abs().max().item() <= 0.02 * want.abs().max().item()
    expected = "int8 per channel" if quantization == "int8" else f"int4, group {group_size}, lm_head int8"
    assert loaded.weights == expected


def test_a_tied_embedding_reads_the_int8_head_rows(checkpoint_dirs: dict[str, Path]) -> None:
    model = load_model(str(checkpoint_dirs["qwen2"]), quantization="int8", **KW).model
    embed = model.model.embed_tokens
    assert embed.weight.numel() == 0 and model.lm_head.weight.numel() == 0  # the float table is gone
    ids = torch.tensor([0, 3, 511, 3])
    assert model.lm_head.quant is not None
    assert torch.equal(embed(ids), model.lm_head.quant.dequantize()[ids])


def test_weight_bytes_counts_parameters_and_quantized_buffers(llama_dir: Path) -> None:
    plain = load_model(str(llama_dir), **KW)
    assert plain.weight_bytes == sum(p.numel() * 4 for p in plain.model.parameters())
    assert plain.weights == "float32"
    int8 = load_model(str(llama_dir), quantization="int8", **KW)
    linears = [m.quant for m in int8.model.modules() if isinstance(m, ParallelLinear)]
    assert all(isinstance(q, Int8Linear) for q in linears)
    buffers = sum(int(q.qweight.numel() + 2 * q.scales.numel()) for q in linears if isinstance(q, Int8Linear))
    head = int8.model.lm_head.quant
    assert head is not None
    floats = sum(p.numel() * 4 for p in int8.model.parameters())
    assert int8.weight_bytes == floats + buffers + head.qweight.numel() + 2 * head.scales.numel()


def test_unsupported_settings_are_refused_by_name(llama_dir: Path) -> None:
    cases: list[tuple[dict[str, object], str, str]] = [
        ({"quantization": "int4"}, "quantization_group_size", "64 input features"),  # default group 128
        ({"quantization": "int3"}, "quantization", "int3"),
        ({"quantization": "int8", "quantization_group_size": 32}, "quantization_group_size", "only"),
        ({"quantization": "int8", "device": "cuda"}, "quantization", "CPU only"),
    ]
    for kwargs, param, needle in cases:
        with pytest.raises(InvalidParameterError) as e:
            load_model(str(llama_dir), **{**KW, **kwargs})
        assert e.value.param == param and needle in e.value.message, (kwargs, e.value)
