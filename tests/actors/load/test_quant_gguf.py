"""int4 straight from GGUF Q4_0 / Q4_1 blocks: exact codes, Q/K un-permutation, TP slices, errors.

The oracle of the codes is the converted folder's float32 weights (the exact
dequantization of the same blocks, ``test_gguf.py`` checks it against the
gguf package and transformers): the ``Int4Codes`` each layer packs must
dequantize (float32 scales and zeros, before the kernel's bfloat16
rounding) to exactly those weights, on one rank and on each of two.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import quants

from actors.load.gguf.convert import ensure_gguf_folder
from actors.load.gguf.dequant import dequantize
from actors.load.gguf.q4_blocks import GROUP_SIZE, q4_codes
from actors.load.gguf.reader import GGUFTensor
from actors.load.loader import load_model, load_tokenizer
from actors.models import quant_linear
from actors.models.layers import ParallelLinear
from actors.models.quant_linear import Int4Codes
from actors.tokenizing import chat_ids
from scheduling.errors import InvalidParameterError
from tests.actors.checkpoints import new_dense, step_logits
from tests.actors.gguf_files import T, gguf_llama_config, write_gguf
from tests.actors.int4_spy import record_int4_codes

Q4_TYPES = [T.Q4_0, T.Q4_1]
PROMPT = [256, 72, 101, 108, 108, 111, 263, 264, 9, 300, 40, 41]


@pytest.mark.parametrize("qtype", Q4_TYPES, ids=lambda t: t.name)
def test_block_codes_dequantize_exactly_to_the_blocks(qtype: T) -> None:
    rng = np.random.default_rng(int(qtype))
    w = (rng.normal(size=(6, 4 * GROUP_SIZE)) + rng.normal(size=(6, 1))).astype(np.float32)
    raw = quants.quantize(w, qtype)
    tensor = GGUFTensor("w", qtype, w.shape, raw)
    codes = q4_codes(tensor)
    assert codes.group_size == GROUP_SIZE and codes.codes.dtype == torch.uint8
    assert int(codes.codes.max()) <= 15 and codes.scales.shape == (6, 4)
    assert torch.equal(codes.dequantize(), torch.from_numpy(quants.dequantize(raw, qtype)))
    assert torch.equal(codes.dequantize(), dequantize(tensor))


@pytest.fixture(scope="module")
def gguf_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[T, Path]:
    root = tmp_path_factory.mktemp("quant_gguf")
    return {
        qtype: ensure_gguf_folder(write_gguf(root / f"llama-{qtype.name}.gguf", qtype, seed=5),
                                  root=root / "cache")
        for qtype in Q4_TYPES
    }


@pytest.fixture
def packed_codes(monkeypatch: pytest.MonkeyPatch) -> dict[int, Int4Codes]:
    """The codes every Int4Linear is built from, by id of the Int4Linear; requantizing is forbidden."""
    def no_requantize(w: torch.Tensor, group_size: int) -> Int4Codes:
        raise AssertionError("a GGUF Q4 linear was requantized from floats")

    seen = record_int4_codes(monkeypatch)
    monkeypatch.setattr(quant_linear, "quantize_int4", no_requantize)
    return seen


def _linears(model: torch.nn.Module) -> dict[str, ParallelLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, ParallelLinear)}


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("qtype", Q4_TYPES, ids=lambda t: t.name)
def test_direct_load_packs_exactly_the_file_codes(
    gguf_folders: dict[T, Path], packed_codes: dict[int, Int4Codes], qtype: T, world_size: int
) -> None:
    folder = gguf_folders[qtype]
    for rank in range(world_size):
        kw: dict[str, Any] = {"dtype": torch.float32, "device": "cpu", "max_model_len": 64, "rank": rank, "world_size": world_size}
        ref = _linears(load_model(str(folder), **kw).model)
        loaded = load_model(str(folder), quantization="int4", **kw)
        assert "14 linears from GGUF Q4 blocks" in loaded.weights
        got = _linears(loaded.model)
        assert set(got) == set(ref)
        for name, layer in got.items():
            assert layer.quant is not None and layer.weight.numel() == 0, name
            codes = packed_codes[id(layer.quant)]
            assert torch.equal(codes.dequantize(), ref[name].weight), name
        assert loaded.model.lm_head.quant is not None  # int8, requantized from the Q4 head blocks' floats


@pytest.mark.parametrize("qtype", Q4_TYPES, ids=lambda t: t.name)
def test_bf16_scales_move_the_logits_little(gguf_folders: dict[T, Path], qtype: T) -> None:
    """Against the exact (float32) dequantized model: the int8 per-row head (this file's vocab is Q4,
    requantized), and with torch's kernels bfloat16 activations, scales and zeros. Measured with torch's
    kernels: 0.95% of the logits' scale; allowed: 2%."""
    kw: dict[str, Any] = {"dtype": torch.float32, "device": "cpu", "max_model_len": 64}
    ref = load_model(str(gguf_folders[qtype]), **kw).model
    model = load_model(str(gguf_folders[qtype]), quantization="int4", **kw).model
    want = step_logits(ref, new_dense(ref), [(0, PROMPT, 0)])[0]
    got = step_logits(model, new_dense(model), [(0, PROMPT, 0)])[0]
    assert (got - want).abs().max().item() <= 0.02 * want.abs().max().item()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_q8_0_vocab_blocks_load_as_they_are_and_int4_is_the_file_s_model(tmp_path: Path, tied: bool) -> None:
    """Q4_1 linears and a Q8_0 embedding / head, as llama.cpp's Q4 files store them: with the native
    kernels, --quantization int4 multiplies by exactly the file's weights, so its logits are the float32
    model's (the dequantized same blocks) up to float32 summation order."""
    config = gguf_llama_config(tie_word_embeddings=tied)
    path = write_gguf(tmp_path / "q8vocab.gguf", T.Q4_1, config=config, seed=3, vocab_qtype=T.Q8_0)
    folder = ensure_gguf_folder(path, root=tmp_path / "cache")
    kw: dict[str, Any] = {"dtype": torch.float32, "device": "cpu", "max_model_len": 64}
    ref = load_model(str(folder), **kw).model
    loaded = load_model(str(folder), quantization="int4", **kw)
    assert loaded.weights == "int4, group 32, 14 linears from GGUF Q4 blocks, lm_head from GGUF Q8_0 blocks"
    model = loaded.model
    for table in ([model.lm_head] + ([model.model.embed_tokens] if tied else [])):
        assert table.quant is not None and table.quant.group_size == GROUP_SIZE and table.weight.numel() == 0
        assert torch.equal(table.quant.dequantize(), ref.lm_head.weight)  # the file's values, no requantizing
    if tied:
        assert model.model.embed_tokens.quant is model.lm_head.quant
    else:  # each from its own blocks
        embed = model.model.embed_tokens.quant
        assert embed is not None and torch.equal(embed.dequantize(), ref.model.embed_tokens.weight)
    want = step_logits(ref, new_dense(ref), [(0, PROMPT, 0)])[0]
    got = step_logits(model, new_dense(model), [(0, PROMPT, 0)])[0]
    assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()


def test_other_group_sizes_and_a_missing_file_are_refused_by_name(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "moved.gguf", T.Q4_1, seed=1)
    folder = ensure_gguf_folder(path, root=tmp_path / "cache")
    kw: dict[str, Any] = {"dtype": torch.float32, "device": "cpu", "max_model_len": 64}
    with pytest.raises(InvalidParameterError) as e:
        load_model(str(folder), quantization="int4", quantization_group_size=64, **kw)
    assert e.value.param == "quantization_group_size" and "32" in e.value.message
    shutil.move(path, tmp_path / "elsewhere.gguf")
    with pytest.raises(InvalidParameterError) as e:
        load_model(str(folder), quantization="int4", **kw)
    assert e.value.param == "model" and "moved.gguf" in e.value.message
    assert load_model(str(folder), quantization="int8", **kw).weights == "int8 per channel"


def test_smollm2_loads_its_q4_1_blocks_in_a_fifth_of_the_memory(smollm2_dir: Path) -> None:
    """The real preset: 210 Q4_1 linears and the Q8_0 head read directly, 90 MiB of weights instead of
    513 MiB; with the native kernels the logits of a chat prompt are the float32 model's up to summation
    order (within 1e-4 of their scale; torch's kernels round activations to bfloat16: within 5%)."""
    kw: dict[str, Any] = {"dtype": torch.float32, "device": "cpu", "max_model_len": 128}
    ref = load_model(str(smollm2_dir), **kw)
    loaded = load_model(str(smollm2_dir), quantization="int4", **kw)
    assert loaded.weights == "int4, group 32, 210 linears from GGUF Q4 blocks, lm_head from GGUF Q8_0 blocks"
    assert loaded.weight_bytes < ref.weight_bytes / 5
    native = all(m.quant.float32_products for m in _linears(loaded.model).values() if m.quant is not None)
    ids = chat_ids(load_tokenizer(smollm2_dir), [{"role": "user", "content": "What is the capital of France?"}])
    want = step_logits(ref.model, new_dense(ref.model), [(0, ids, 0)])[0]
    got = step_logits(loaded.model, new_dense(loaded.model), [(0, ids, 0)])[0]
    assert (got - want).abs().max().item() <= (1e-4 if native else 0.05) * want.abs().max().item()
    assert int(got[-1].argmax()) == int(want[-1].argmax())
