"""Session fixtures: seeded tiny checkpoints written once per test session."""

from __future__ import annotations

import os
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

ROOT = Path(__file__).resolve().parents[2]  # the checkout the tests import


@pytest.fixture(autouse=True)
def _single_thread_torch() -> Iterator[None]:
    """Tiny matmuls are far faster on one thread, and a busy CI box makes
    torch's thread pool spin (measured: 100x slower decode steps). Restored after."""
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


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    """One private local Ray cluster on loopback per module that asks; auth off for it.

    Its workers import this checkout (PYTHONPATH), so a test may run its own helpers
    inside a live actor (``actor.__ray_call__``, as ``tests.actors.step_faults`` does).
    """
    # Ray is imported here, not at the top: the device check (scripts/gpu_check.sh) runs this
    # folder's gpu tests on a machine without Ray, and this conftest loads for every test here.
    import ray

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_AUTH_MODE", "disabled")
        mp.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
        # address="local": never attach to another cluster running on this machine.
        ray.init(address="local", num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1",
                 log_to_driver=False)
        try:
            yield
        finally:
            ray.shutdown()
