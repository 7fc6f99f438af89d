"""compressed-tensors ``pack-quantized`` int4 checkpoints (GPTQ/AWQ layout) loaded as int4 codes.

The checkpoint is written by the compressed-tensors package itself
(``apply_quantization_config``, min-max group parameters, ``ModelCompressor``),
and the reference is the package's own decompression of the saved tensors
(``PackedQuantizationCompressor.decompress``) loaded as a plain float
checkpoint. Codes: each layer's ``Int4Codes`` dequantize to the package's
weights (float32 rounding); logits: within 2% of the logits' scale (the
activations and outputs are rounded to bfloat16 in the int4 linears;
measured 0.7% symmetric, 0.9% with zero points).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch
from compressed_tensors.compressors import ModelCompressor, PackedQuantizationCompressor
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    apply_quantization_config,
)
from compressed_tensors.quantization.utils import calculate_qparams
from safetensors.torch import load_file, save_file

from actors.load.loader import load_model
from actors.load.quant.compressed_tensors import read_scheme
from actors.models.layers import ParallelLinear
from scheduling.errors import InvalidParameterError
from tests.actors.checkpoints import build_hf_model, llama_config, new_dense, step_logits
from tests.actors.int4_spy import record_int4_codes

GROUP = 32
PROMPT = [1, 17, 300, 4, 4, 99, 511, 256, 3, 0]
KW: dict[str, Any] = {"dtype": torch.float32, "device": "cpu", "max_model_len": 64}


def _args(symmetric: bool) -> QuantizationArgs:
    return QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=GROUP)


def write_compressed(folder: Path, *, symmetric: bool, seed: int = 0) -> Path:
    """A tiny Llama quantized (min-max, groups of 32) and saved by compressed-tensors; lm_head ignored."""
    model = build_hf_model(llama_config(), seed)
    args = _args(symmetric)
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
                                ignore=["lm_head"], format="pack-quantized")
    apply_quantization_config(model, config)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "weight_scale"):
                w = module.get_parameter("weight").unflatten(-1, (-1, GROUP))
                scale, zero = calculate_qparams(w.amin(-1), w.amax(-1), args)
                module.get_parameter("weight_scale").copy_(scale)
                if hasattr(module, "weight_zero_point"):
                    module.get_parameter("weight_zero_point").copy_(zero)
    compressor = ModelCompressor.from_pretrained_model(model, "pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(folder)
    compressor.update_config(str(folder))
    return folder


def write_decompressed(compressed: Path, folder: Path, *, symmetric: bool) -> Path:
    """The package's own float decompression of ``compressed``, as a plain checkpoint."""
    state = load_file(str(compressed / "model.safetensors"))
    modules: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    plain: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        prefix, _, leaf = name.rpartition(".")
        if leaf.startswith("weight_"):
            modules[prefix][leaf] = tensor
        else:
            plain[name] = tensor
    scheme = QuantizationScheme(targets=["Linear"], weights=_args(symmetric))
    for prefix, parts in modules.items():
        plain[f"{prefix}.weight"] = PackedQuantizationCompressor.decompress(parts, scheme)["weight"].float()
    folder.mkdir()
    save_file(plain, str(folder / "model.safetensors"))
    config = json.loads((compressed / "config.json").read_text())
    del config["quantization_config"]
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module", params=[True, False], ids=["symmetric", "zero-points"])
def folders(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("ct")
    compressed = write_compressed(root / "compressed", symmetric=request.param)
    return compressed, write_decompressed(compressed, root / "reference", symmetric=request.param)


@pytest.mark.parametrize("quantization", [None, "compressed-tensors"])
def test_loads_the_codes_and_matches_the_package_decompression(
    folders: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, quantization: str | None
) -> None:
    seen = record_int4_codes(monkeypatch)
    compressed, reference = folders
    loaded = load_model(str(compressed), quantization=quantization, **KW)
    ref = load_model(str(reference), **KW).model
    assert loaded.weights.startswith(f"int4, group {GROUP}, compressed-tensors")
    ref_layers = {n: m for n, m in ref.named_modules() if isinstance(m, ParallelLinear)}
    for name, layer in loaded.model.named_modules():
        if isinstance(layer, ParallelLinear):
            assert layer.quant is not None and layer.weight.numel() == 0, name
            torch.testing.assert_close(seen[id(layer.quant)].dequantize(), ref_layers[name].weight,
                                       rtol=1e-6, atol=1e-7)
    head = loaded.model.lm_head
    assert head.quant is None and torch.equal(head.weight, ref.lm_head.weight)  # "ignore": ["lm_head"]
    want = step_logits(ref, new_dense(ref), [(0, PROMPT, 0)])[0]
    got = step_logits(loaded.model, new_dense(loaded.model), [(0, PROMPT, 0)])[0]
    assert (got - want).abs().max().item() <= 0.02 * want.abs().max().item()


def test_mismatched_settings_are_refused_by_name(folders: tuple[Path, Path]) -> None:
    compressed, reference = folders
    for method in ("int8", "int4"):
        with pytest.raises(InvalidParameterError) as e:
            load_model(str(compressed), quantization=method, **KW)
        assert e.value.param == "quantization" and "already quantized" in e.value.message
    with pytest.raises(InvalidParameterError) as e:
        load_model(str(reference), quantization="compressed-tensors", **KW)
    assert e.value.param == "quantization" and "not a compressed-tensors checkpoint" in e.value.message


@pytest.mark.parametrize(("change", "needle"), [
    ({"num_bits": 8}, "4-bit"),
    ({"strategy": "channel", "group_size": None}, "strategy"),
    ({"group_size": 16}, "group size 16"),
])
def test_unsupported_schemes_are_refused_naming_the_model(change: dict[str, object], needle: str) -> None:
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32, **change}
    config = {"quant_method": "compressed-tensors", "format": "pack-quantized",
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}}
    with pytest.raises(InvalidParameterError) as e:
        read_scheme(config)
    assert e.value.param == "model" and needle in e.value.message
