"""The scheduler in the caller's process (``scheduler_placement=replica``), as a ``SchedulerHandle``.

No Ray cluster: ``LocalScheduler`` runs ``SchedulerService`` on the test's
own event loop, the forward on its engine thread.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace
from typing import Any

import pytest

from actors.api import EngineStats, RequestOutput
from actors.config import EngineConfig
from actors.remote.cpu_threads import usable_cores
from actors.scheduler.local import LocalScheduler, with_forward_threads
from apps.llm import LLM
from scheduling.errors import InvalidParameterError
from scheduling.sampling_params import SamplingParams
from tests.actors.checkpoints import write_llama_with_tokenizer

ENGINE: dict[str, Any] = {"max_model_len": 128, "max_num_seqs": 8, "max_num_batched_tokens": 256,
                          "dtype": "float32", "device": "cpu", "num_kv_pages": 64, "cpu_threads": 1}
PROMPTS = [[5 + (i * 7 + j * 3) % 200 for j in range(6 + 4 * i)] for i in range(4)]
GREEDY = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)
TIMEOUT = 30.0


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> EngineConfig:
    folder = write_llama_with_tokenizer(tmp_path_factory.mktemp("local_sched"))
    return EngineConfig(model=str(folder), **ENGINE)


def _all_free(stats: EngineStats) -> bool:
    return (stats.num_unfinished_requests == 0 and stats.num_kv_pages_locked == 0
            and stats.num_kv_pages_free + stats.num_kv_pages_evictable == stats.num_kv_pages_total)


def test_generate_matches_the_offline_engine(config: EngineConfig) -> None:
    llm = LLM(config.model, **{k: v for k, v in ENGINE.items()})
    try:
        expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        llm.shutdown()

    async def run() -> list[RequestOutput]:
        handle = LocalScheduler(config)
        try:
            return list(await asyncio.gather(*(handle.generate(f"r{i}", p, GREEDY)
                                               for i, p in enumerate(PROMPTS))))
        finally:
            await handle.shutdown()

    got = asyncio.run(asyncio.wait_for(run(), TIMEOUT))
    assert [o.outputs[0].token_ids for o in got] == expected


def test_a_consumer_polls_every_delta_and_pages_come_back(config: EngineConfig) -> None:
    async def run() -> tuple[dict[str, list[int]], dict[str, str | None], EngineStats]:
        handle = LocalScheduler(config)
        tokens: dict[str, list[int]] = {}
        reasons: dict[str, str | None] = {}
        try:
            lengths = await asyncio.gather(*(handle.submit(f"s{i}", p, GREEDY, consumer_id="c")
                                             for i, p in enumerate(PROMPTS)))
            assert lengths == [len(p) for p in PROMPTS]
            while len(reasons) < len(PROMPTS) or any(r is None for r in reasons.values()):
                for message in await handle.next_outputs("c", 1.0):
                    for d in message.deltas:
                        tokens.setdefault(d.request_id, []).extend(d.token_ids)
                        reasons[d.request_id] = d.finish_reason
            return tokens, reasons, await handle.stats()
        finally:
            await handle.shutdown()

    tokens, reasons, stats = asyncio.run(asyncio.wait_for(run(), TIMEOUT))
    assert all(len(t) == GREEDY.max_tokens for t in tokens.values()) and len(tokens) == len(PROMPTS)
    assert set(reasons.values()) == {"length"}
    assert _all_free(stats), stats


def test_abort_frees_the_pages_of_a_running_request(config: EngineConfig) -> None:
    long = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)

    async def run() -> tuple[bool, EngineStats, EngineStats]:
        handle = LocalScheduler(config)
        try:
            await handle.submit("long", PROMPTS[3], long, consumer_id="c")
            while not any(d.token_ids for m in await handle.next_outputs("c", 1.0) for d in m.deltas):
                pass  # next_outputs waits for a step: this loop does not spin
            busy = await handle.stats()
            aborted = await handle.abort("long")
            return aborted, busy, await handle.stats()
        finally:
            await handle.shutdown()

    aborted, busy, after = asyncio.run(asyncio.wait_for(run(), TIMEOUT))
    assert aborted and busy.num_kv_pages_free < busy.num_kv_pages_total and busy.num_running == 1
    assert _all_free(after), after


def test_a_call_from_another_threads_loop_runs_on_the_services_loop(config: EngineConfig) -> None:
    """Serve may call a replica's stats hooks off its user loop: the call is handed over, not run there."""
    seen: list[EngineStats | BaseException] = []

    async def run() -> None:
        handle = LocalScheduler(config)
        try:
            await handle.generate("warm", PROMPTS[0], GREEDY)

            def other_thread() -> None:
                async def ask() -> EngineStats:
                    stats: EngineStats = await handle.stats()
                    return stats
                try:
                    seen.append(asyncio.run(ask()))
                except BaseException as exc:  # reported by the assertion below
                    seen.append(exc)

            worker = threading.Thread(target=other_thread)
            worker.start()
            # The service's loop must keep running while the other thread waits on it.
            await asyncio.get_running_loop().run_in_executor(None, worker.join, TIMEOUT)
        finally:
            await handle.shutdown()

    asyncio.run(asyncio.wait_for(run(), TIMEOUT))
    assert len(seen) == 1 and isinstance(seen[0], EngineStats), seen
    assert seen[0].num_steps > 0


def test_bad_input_and_unknown_methods_are_clear_errors(config: EngineConfig) -> None:
    async def run() -> None:
        handle = LocalScheduler(config)
        try:
            with pytest.raises(InvalidParameterError) as err:
                await handle.submit("bad", [1] * 500, GREEDY, consumer_id="c")  # longer than max_model_len
            assert err.value.param
            with pytest.raises(AttributeError, match="'step'"):
                handle.step()
        finally:
            await handle.shutdown()

    asyncio.run(asyncio.wait_for(run(), TIMEOUT))


def test_close_stops_the_engine_thread_without_a_loop(config: EngineConfig) -> None:
    handle = LocalScheduler(config)  # no running loop: built as a replica's __init__ might be
    handle.close()
    with pytest.raises(RuntimeError):
        handle.service._thread.submit(lambda: None)  # the engine thread takes no more work



def test_the_forward_takes_every_core_unless_threads_are_set(config: EngineConfig) -> None:
    """Serve's default one-CPU reservation of a replica must not make a one-thread forward."""
    unset = replace(config, cpu_threads=None)
    assert with_forward_threads(unset).cpu_threads == usable_cores()  # no Ray here: nothing reserved
    assert with_forward_threads(replace(config, cpu_threads=1)).cpu_threads == 1
