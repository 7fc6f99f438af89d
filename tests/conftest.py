"""Session fixtures shared by every test package."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded tiny model, written once per session."""
    from actors.embedded_models import ensure_embedded_model

    return ensure_embedded_model("tiny", root=tmp_path_factory.mktemp("flotilla_cache"))
