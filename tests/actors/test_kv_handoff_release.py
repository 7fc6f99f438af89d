"""Prefill/decode disaggregation in process when a hand-over does not complete: nothing is left behind.

A prefill cancelled while its KV is exported keeps no export.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from typing import Any

import pytest

from actors.engine_config import EngineConfig
from actors.engine_stats import EngineStats
from actors.kv_handoff import PrefillResult
from actors.outputs import SequenceDelta
from actors.scheduler_actor import SchedulerService
from tests.actors.checkpoints import write_llama_with_tokenizer
from tests.actors.step_faults import HeldExportExecutor
from tests.actors.test_kv_handoff import ENGINE, GREEDY, PROMPTS, assert_all_free

PROMPT = PROMPTS[-1]  # 102 tokens: chunked prefill, six full pages and a part
TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> EngineConfig:
    return EngineConfig(model=str(write_llama_with_tokenizer(tmp_path_factory.mktemp("pd_release"))), **ENGINE)


async def wait_for_steps(service: SchedulerService, num_steps: int) -> None:
    """Poll until ``service`` has run ``num_steps`` steps (short backoff, bounded)."""
    deadline, backoff = time.monotonic() + TIMEOUT_S, 0.005
    while (await service.stats()).num_steps < num_steps:
        assert time.monotonic() < deadline, f"the service did not reach step {num_steps}"
        await asyncio.sleep(backoff)
        backoff = min(2 * backoff, 0.2)


async def finals(service: SchedulerService, consumer: str, request_ids: set[str]) -> dict[str, SequenceDelta]:
    """The final delta of each of ``request_ids`` on ``consumer``."""
    ends: dict[str, SequenceDelta] = {}
    deadline = time.monotonic() + TIMEOUT_S
    while set(ends) != request_ids:
        assert time.monotonic() < deadline, f"{sorted(request_ids - set(ends))} did not finish"
        for message in await service.next_outputs(consumer, timeout_s=1.0):
            ends.update({d.request_id: d for d in message.deltas if d.finish_reason is not None})
    return ends


def test_a_prefill_cancelled_while_its_kv_is_exported_keeps_no_export(config: EngineConfig) -> None:
    entered, release = threading.Event(), threading.Event()

    async def scenario() -> tuple[dict[str, Any], EngineStats, PrefillResult, dict[str, Any], EngineStats, bool]:
        held = functools.partial(HeldExportExecutor, entered=entered, release=release)
        service = SchedulerService(config, executor_factory=held)
        try:
            task = asyncio.ensure_future(service.prefill("cancelled", PROMPT, GREEDY))
            # The step that samples the first token and copies the prompt's pages out is running.
            assert await asyncio.get_running_loop().run_in_executor(None, entered.wait, TIMEOUT_S)
            step = (await service.stats()).num_steps + 1
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            release.set()
            await wait_for_steps(service, step)
            after_cancel = dict(service._engine.exported), await service.stats()
            # The scheduler steps again: the same prompt prefills whole.
            again = await asyncio.wait_for(service.prefill("again", PROMPT, GREEDY), TIMEOUT_S)
            return (*after_cancel, again, dict(service._engine.exported), await service.stats(),
                    (await service.health()).ok)
        finally:
            release.set()
            await service.shutdown()

    exported, stats, again, exported_after, stats_after, healthy = asyncio.run(scenario())
    assert exported == {}, f"the cancelled prefill's KV is kept: {sorted(exported)}"
    assert_all_free(stats)
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert again.kv_bytes > 0 and again.num_prompt_tokens == len(PROMPT)
    assert exported_after == {} and healthy
    assert_all_free(stats_after)
