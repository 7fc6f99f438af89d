"""How many torch threads an engine's forward gets on CPU (``actors.cpu_threads``)."""

from __future__ import annotations

import asyncio
import os
from dataclasses import replace

import pytest
import ray
import torch

from actors.cpu_threads import engine_cpu_threads, ray_reserved_cpus, usable_cores
from actors.embedded_models import build_tokenizer
from actors.engine_config import EngineConfig
from actors.scheduler_actor import SchedulerService
from scheduling.errors import InvalidParameterError
from tests.actors.checkpoints import llama_config, write_checkpoint

ENGINE = {"max_model_len": 64, "max_num_seqs": 2, "num_kv_pages": 16, "dtype": "float32", "device": "cpu"}


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> EngineConfig:
    folder = write_checkpoint(tmp_path_factory.mktemp("threads"), llama_config(), seed=0)
    build_tokenizer().save_pretrained(folder)
    return EngineConfig(model=str(folder), **ENGINE)


def test_usable_cores_is_the_affinity() -> None:
    assert usable_cores() == len(os.sched_getaffinity(0)) >= 1


def test_configured_threads_win() -> None:
    assert engine_cpu_threads(3) == 3


def test_outside_ray_every_usable_core() -> None:
    assert not ray.is_initialized()
    assert ray_reserved_cpus() == 0.0
    assert engine_cpu_threads(None) == usable_cores()


@pytest.mark.parametrize("bad", [0, -2, "2", 1.5, True])
def test_bad_cpu_threads_names_the_field(bad: object) -> None:
    with pytest.raises(InvalidParameterError) as err:
        EngineConfig(cpu_threads=bad)  # type: ignore[arg-type]
    assert err.value.param == "cpu_threads"


def _engine_thread_count(config: EngineConfig) -> int:
    """torch's thread count as seen on the scheduler's engine-step thread."""
    async def scenario() -> int:
        svc = SchedulerService(config)
        try:
            return await asyncio.get_running_loop().run_in_executor(svc._thread, torch.get_num_threads)
        finally:
            await svc.shutdown()

    return asyncio.run(scenario())


@pytest.mark.parametrize("threads", [1, 2])
def test_scheduler_forward_thread_uses_the_configured_count(config: EngineConfig, threads: int) -> None:
    assert _engine_thread_count(replace(config, cpu_threads=threads)) == threads


def test_scheduler_forward_thread_defaults_to_every_core(config: EngineConfig) -> None:
    """Ray leaves its workers one OpenMP thread; the engine takes the node's cores back."""
    torch.set_num_threads(1)  # as a Ray worker starts (OMP_NUM_THREADS=1); the fixture restores it
    assert _engine_thread_count(config) == usable_cores()
