"""Session fixtures: seeded tiny checkpoints written once per test session."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from transformers import PretrainedConfig

from actors.load.embedded import ensure_embedded_model
from tests.actors.checkpoints import (
    llama3_config,
    llama_config,
    mistral_config,
    qwen2_config,
    write_checkpoint,
)

CONFIGS: dict[str, Callable[[], PretrainedConfig]] = {
    "llama": llama_config,
    "llama3_rope": llama3_config,
    "qwen2": qwen2_config,
    "mistral": mistral_config,
}

@pytest.fixture(autouse=True)
def _single_thread_torch() -> Iterator[None]:
    """Tiny matmuls are far faster on one thread, and a busy CI box makes
    torch's thread pool spin (measured: 100x slower decode steps). Restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", autouse=True)
def _single_thread_torch_for_module_fixtures() -> Iterator[None]:
    """The same for a module's fixtures (checkpoints, HF oracle outputs), which pytest sets up before the
    function-scoped fixture above (an autouse fixture comes first within its scope): on a busy box the HF
    reference generations crawled on the default thread pool."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def checkpoint_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Folders of every tiny architecture in ``CONFIGS`` (seed = position in the dict)."""
    return {
        name: write_checkpoint(tmp_path_factory.mktemp(name), make(), seed=seed)
        for seed, (name, make) in enumerate(CONFIGS.items())
    }


@pytest.fixture(scope="session")
def llama_dir(checkpoint_dirs: dict[str, Path]) -> Path:
    """The tiny GQA Llama checkpoint."""
    return checkpoint_dirs["llama"]


@pytest.fixture(scope="session")
def sharded_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama (same seed as ``llama_dir``) saved in many small shards."""
    return write_checkpoint(tmp_path_factory.mktemp("sharded"), llama_config(), seed=0, max_shard_size="40KB")


@pytest.fixture(scope="session")
def flotilla_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private flotilla cache root for this session (never the user's ~/.cache)."""
    return tmp_path_factory.mktemp("flotilla_cache")


@pytest.fixture(scope="session")
def tiny_dir(flotilla_cache: Path) -> Path:
    """The embedded ``tiny`` model, built into the session cache."""
    return ensure_embedded_model("tiny", root=flotilla_cache)
