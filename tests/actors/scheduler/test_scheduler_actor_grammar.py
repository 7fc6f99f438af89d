"""The scheduler service compiles constraints off its loop: steps go on meanwhile, and a slow compile is refused.

In process (``SchedulerService``, no Ray): the compile worker is held on an
event, so "the compile is still running" is a fact of the test, not a timing.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import replace
from typing import Any

import pytest

from actors.config import EngineConfig
from actors.grammar.compiler import GrammarCompiler
from actors.scheduler.actor import SchedulerService
from scheduling.errors import InvalidParameterError
from scheduling.sampling_params import SamplingParams
from scheduling.structured_output import StructuredOutput
from tests.actors.checkpoints import write_llama_with_tokenizer

ENGINE: dict[str, Any] = {"max_model_len": 128, "max_num_seqs": 8, "max_num_batched_tokens": 256,
                          "dtype": "float32", "device": "cpu", "num_kv_pages": 64}
PROMPT = [5 + (j * 7) % 200 for j in range(12)]
FREE = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
CHOICE = StructuredOutput.choice(["alpha", "beta"], param="structured_outputs.choice")
TIMEOUT = 60.0


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> EngineConfig:
    return EngineConfig(model=str(write_llama_with_tokenizer(tmp_path_factory.mktemp("sched_grammar"))), **ENGINE)


def held_compiles(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Make every compile wait for the returned event before it runs."""
    release = threading.Event()
    compile_ = GrammarCompiler._compile

    def held(self: GrammarCompiler, kind: str, spec: str) -> Any:
        assert release.wait(TIMEOUT), "the test never released the compile"
        return compile_(self, kind, spec)

    monkeypatch.setattr(GrammarCompiler, "_compile", held)
    return release


def test_steps_go_on_while_a_constraint_compiles(config: EngineConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    release = held_compiles(monkeypatch)

    async def scenario() -> tuple[Any, Any, Any]:
        svc = SchedulerService(config)
        constrained = asyncio.ensure_future(svc.generate(
            "constrained", PROMPT, SamplingParams(max_tokens=12, temperature=0.0, structured_output=CHOICE)))
        # The other request runs to its end while the compile is held.
        free = await asyncio.wait_for(svc.generate("free", PROMPT, FREE), TIMEOUT)
        assert not constrained.done()
        release.set()
        done = await asyncio.wait_for(constrained, TIMEOUT)
        stats = await svc.stats()
        await svc.shutdown()
        return free, done, stats

    free, done, stats = asyncio.run(scenario())
    assert free.outputs[0].finish_reason == "length" and len(free.outputs[0].token_ids) == 12
    assert done.outputs[0].text in ("alpha", "beta") and done.outputs[0].finish_reason == "stop"
    assert dict(stats.structured_output_requests) == {"choice": 1} and stats.grammar_compiles_total == 1
    assert stats.num_kv_pages_locked == 0 and stats.num_kv_pages_free + stats.num_kv_pages_evictable == stats.num_kv_pages_total


def test_a_compile_past_the_bound_is_refused_and_the_replica_serves_on(
    config: EngineConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = held_compiles(monkeypatch)

    async def scenario() -> tuple[InvalidParameterError, Any, Any]:
        svc = SchedulerService(replace(config, grammar_compile_timeout_s=0.2))
        with pytest.raises(InvalidParameterError) as info:
            await svc.submit("slow", PROMPT, SamplingParams(max_tokens=8, structured_output=CHOICE))
        free = await asyncio.wait_for(svc.generate("free", PROMPT, FREE), TIMEOUT)
        release.set()  # the worker finishes the compile; nothing was queued for it
        stats = await svc.stats()
        await svc.shutdown()
        return info.value, free, stats

    err, free, stats = asyncio.run(scenario())
    assert err.param == "structured_outputs.choice" and "did not compile within 0.2 s" in err.message
    assert free.outputs[0].finish_reason == "length"
    assert stats.num_unfinished_requests == 0 and dict(stats.structured_output_requests) == {}


def test_the_compiled_grammar_is_handed_to_the_engine_not_looked_up_again(
    config: EngineConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    # More distinct constraints in flight than the compiler caches: the first one's entry is evicted
    # while it waits. Looked up again under the engine lock, it would compile a second time there.
    release = held_compiles(monkeypatch)
    other = StructuredOutput.choice(["gamma", "delta"], param="structured_outputs.choice")

    async def scenario() -> tuple[Any, Any, Any]:
        svc = SchedulerService(config)
        svc._engine.grammar.max_cached = 1
        first = asyncio.ensure_future(svc.generate(
            "first", PROMPT, SamplingParams(max_tokens=12, temperature=0.0, structured_output=CHOICE)))
        second = asyncio.ensure_future(svc.generate(
            "second", PROMPT, SamplingParams(max_tokens=12, temperature=0.0, structured_output=other)))
        deadline = time.monotonic() + TIMEOUT
        while other.key not in svc._engine.grammar._cache:  # the second compile evicted the first's entry
            assert time.monotonic() < deadline, "the second constraint never reached the compiler"
            await asyncio.sleep(0.01)
        release.set()
        done = await asyncio.wait_for(asyncio.gather(first, second), TIMEOUT)
        stats = await svc.stats()
        await svc.shutdown()
        return done[0], done[1], stats

    first, second, stats = asyncio.run(scenario())
    assert first.outputs[0].text in ("alpha", "beta") and second.outputs[0].text in ("gamma", "delta")
    assert stats.grammar_compiles_total == 2  # each constraint compiled once
    assert stats.num_unfinished_requests == 0
    assert stats.num_kv_pages_locked == 0 and stats.num_kv_pages_free + stats.num_kv_pages_evictable == stats.num_kv_pages_total
