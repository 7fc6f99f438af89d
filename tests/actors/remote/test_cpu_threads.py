"""How many torch threads an engine's forward gets on CPU (``actors.remote.cpu_threads``)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from actors.config import EngineConfig
from actors.engine.executor import LocalExecutor
from actors.load.embedded import build_tokenizer
from actors.remote import shard_actor
from actors.remote.cpu_threads import (
    call_on_new_thread,
    engine_cpu_threads,
    engine_thread_init,
    usable_cores,
)
from actors.scheduler.actor import SchedulerService
from scheduling.batch import Batch, StepOutput
from scheduling.errors import InvalidParameterError
from scheduling.sampling_params import SamplingParams
from tests.actors.checkpoints import llama_config, write_checkpoint

ROOT = Path(__file__).resolve().parents[3]  # the checkout: the subprocess imports it
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
    # In a process of its own: this one may be running the session's shared cluster.
    code = ("import json, ray; from actors.remote.cpu_threads import engine_cpu_threads, ray_reserved_cpus, "
            "usable_cores; print(json.dumps([ray.is_initialized(), ray_reserved_cpus(), engine_cpu_threads(None), "
            "usable_cores()]))")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    initialized, reserved, threads, cores = json.loads(run.stdout.strip().splitlines()[-1])
    assert not initialized
    assert reserved == 0.0
    assert threads == cores >= 1


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


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def test_call_on_new_thread_returns_the_value_of_another_thread() -> None:
    ident, threads = call_on_new_thread(lambda: (threading.get_ident(), torch.get_num_threads()), 2)
    assert ident != threading.get_ident()
    assert threads == 2
    assert torch.get_num_threads() == 1  # the caller's count is untouched (the conftest fixture set 1)


def test_call_on_new_thread_raises_the_error_of_fn() -> None:
    def fail() -> None:
        raise KeyError("missing")

    with pytest.raises(KeyError, match="missing"):
        call_on_new_thread(fail, 1)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through Linux /proc")
def test_call_on_new_thread_leaves_no_openmp_team_behind() -> None:
    """The parallel op starts a team of workers; they end with the thread (GNU OpenMP frees its pool)."""
    before = _os_threads()
    total = call_on_new_thread(lambda: float((torch.ones(4_000_000) * 2).sum()), 2)
    assert total == 8_000_000.0
    deadline = time.monotonic() + 5.0  # the workers exit asynchronously, within milliseconds
    while _os_threads() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _os_threads() <= before


def test_the_scheduler_loads_the_model_on_its_forward_thread(config: EngineConfig) -> None:
    """Loading on the caller's thread would leave a second OpenMP team and slow every step."""
    seen: dict[str, int] = {}

    class Recording(LocalExecutor):
        def execute(self, batch: Batch) -> StepOutput:
            seen.setdefault("forward", threading.get_ident())
            return super().execute(batch)

    def factory(cfg: EngineConfig) -> LocalExecutor:
        seen["load"] = threading.get_ident()
        return Recording(cfg)

    async def scenario() -> Any:
        svc = SchedulerService(replace(config, cpu_threads=2), executor_factory=factory)
        try:
            return await svc.generate("r", [1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        finally:
            await svc.shutdown()

    out = asyncio.run(scenario())
    assert len(out.outputs[0].token_ids) == 2
    assert seen["load"] == seen["forward"] != threading.get_ident()


def test_a_shard_loads_on_a_thread_that_ends(config: EngineConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    """The shard's forward runs on serve_steps' thread, so loading must not keep a team alive."""
    loads: list[tuple[int, int]] = []
    real = shard_actor.ModelRunner

    def recording_runner(*args: Any, **kwargs: Any) -> Any:
        loads.append((threading.get_ident(), torch.get_num_threads()))
        return real(*args, **kwargs)

    monkeypatch.setattr(shard_actor, "ModelRunner", recording_runner)
    shard = shard_actor.ModelShardActor(replace(config, cpu_threads=2), rank=0, world_size=1)
    info = shard.start(None)  # type: ignore[arg-type]  # one rank: no rendezvous
    assert info.rank == 0 and info.capacity.num_pages == config.num_kv_pages
    [(ident, threads)] = loads
    assert ident != threading.get_ident() and threads == 2
    assert ident not in {t.ident for t in threading.enumerate()}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread names come from /proc")
def test_engine_thread_is_named_for_the_os_and_its_children_inherit_it() -> None:
    names: list[str] = []

    def comm() -> str:
        return Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip()

    def child() -> None:
        names.append(comm())

    def engine() -> None:
        engine_thread_init(1, "engine-step")
        names.append(comm())
        t = threading.Thread(target=child)  # as torch's OpenMP workers are started from it
        t.start()
        t.join()

    worker = threading.Thread(target=engine)
    worker.start()
    worker.join()
    assert names == ["engine-step", "engine-step"]
    assert comm() != "engine-step"  # only that thread was renamed
