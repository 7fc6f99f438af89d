"""The scheduler actor on a local Ray cluster: outputs, channel, abort, stats, faults."""

from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import replace
from typing import Any

import pytest
import ray

from actors.api import SequenceDelta, StepMessage
from actors.config import EngineConfig
from actors.scheduler.actor import SchedulerActor
from apps.llm import LLM
from scheduling.errors import InvalidParameterError
from scheduling.sampling_params import SamplingParams
from tests.actors.checkpoints import write_llama_with_tokenizer
from tests.actors.fault_injection import FaultyExecutor, Signals

pytestmark = pytest.mark.ray  # on the session's shared cluster: run with the other Ray modules, last (tests/conftest.py)

ENGINE: dict[str, Any] = {"max_model_len": 128, "max_num_seqs": 16, "max_num_batched_tokens": 512,
                          "dtype": "float32", "device": "cpu", "num_kv_pages": 128}
PROMPTS = [[5 + (i * 7 + j * 3) % 200 for j in range(8 + 3 * i)] for i in range(5)]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
TIMEOUT = 30.0


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> EngineConfig:
    """The tiny seeded Llama checkpoint with the byte-level tokenizer."""
    folder = write_llama_with_tokenizer(tmp_path_factory.mktemp("sched_actor"))
    return EngineConfig(model=str(folder), **ENGINE)


@pytest.fixture(scope="module")
def cluster(ray_cluster: None) -> None:
    """The session's shared local Ray cluster (tests/conftest.py); its workers import this test module via
    PYTHONPATH."""


@pytest.fixture(scope="module")
def actor(cluster: None, config: EngineConfig) -> Any:
    return SchedulerActor.remote(config)


def _faulty_actor(config: EngineConfig, **overrides: Any) -> tuple[Any, Any]:
    control = Signals.remote()  # type: ignore[attr-defined]
    factory = functools.partial(FaultyExecutor, control=control)
    return SchedulerActor.remote(replace(config, **overrides), executor_factory=factory), control


@pytest.fixture(scope="module")
def faulty(cluster: None, config: EngineConfig) -> tuple[Any, Any]:
    return _faulty_actor(config, max_num_seqs=2)


def _get(ref: Any) -> Any:
    return ray.get(ref, timeout=TIMEOUT)


def _drain(actor: Any, consumer: str, request_ids: set[str], deadline_s: float = 10.0) -> list[StepMessage]:
    """Poll ``consumer`` until every request in ``request_ids`` finished (bounded)."""
    messages: list[StepMessage] = []
    left = set(request_ids)
    end = time.monotonic() + deadline_s
    while left and time.monotonic() < end:
        for msg in _get(actor.next_outputs.remote(consumer, 1.0)):
            messages.append(msg)
            left -= {d.request_id for d in msg.deltas if d.finish_reason is not None}
    assert not left, f"requests {sorted(left)} did not finish within {deadline_s} s"
    return messages


def _ends(messages: list[StepMessage]) -> dict[str, SequenceDelta]:
    return {d.request_id: d for m in messages for d in m.deltas if d.finish_reason is not None}


def _tokens(messages: list[StepMessage]) -> dict[str, list[int]]:
    ids = {d.request_id for m in messages for d in m.deltas}
    return {r: [t for m in messages for d in m.deltas if d.request_id == r for t in d.token_ids] for r in ids}


def _submit_held(actor: Any, control: Any, ids: list[str], params: SamplingParams, consumer: str) -> None:
    """Submit ``ids[0]``; while its first step is held in the forward, queue the rest (deterministic)."""
    step = _get(actor.stats.remote()).num_steps + 1
    _get(control.plan_.remote(step, "hold"))
    _get(actor.submit.remote(ids[0], PROMPTS[0], params, consumer_id=consumer))
    assert _get(control.wait.remote(f"hold-{step}/in"))
    for i, rid in enumerate(ids[1:], 1):
        _get(actor.submit.remote(rid, PROMPTS[i], params, consumer_id=consumer))
    _get(control.set.remote(f"hold-{step}/out"))


def _assert_pages_free(actor: Any) -> None:
    s = _get(actor.stats.remote())
    assert s.num_kv_pages_free + s.num_kv_pages_evictable == s.num_kv_pages_total, s
    assert s.num_kv_pages_locked == 0 and s.num_running == 0 and s.num_waiting == 0, s
    assert s.num_unfinished_requests == 0, s


def _assert_restart_cycle(actor: Any, control: Any, expected: list[int]) -> None:
    """Health is not ok while the (held) restart runs, pages are free, then a request succeeds."""
    assert _get(control.wait.remote("restart-1/in"))
    health = _get(actor.health.remote())
    assert not health.ok and health.restarting, health
    _assert_pages_free(actor)
    _get(control.set.remote("restart-1/out"))
    out = _get(actor.generate.remote("after", PROMPTS[0], GREEDY))
    assert out.outputs[0].token_ids == expected and out.outputs[0].finish_reason == "length"
    assert _get(actor.health.remote()).ok
    _assert_pages_free(actor)


def test_greedy_matches_in_process_llm(actor: Any, config: EngineConfig) -> None:
    expected = LLM(config.model, **ENGINE).generate(PROMPTS, GREEDY, use_tqdm=False)
    outs = _get([actor.generate.remote(f"g{i}", p, GREEDY) for i, p in enumerate(PROMPTS)])
    for e, g in zip(expected, outs, strict=True):
        e0, g0 = e.outputs[0], g.outputs[0]
        assert (g0.token_ids, g0.text, g.prompt_token_ids) == (e0.token_ids, e0.text, e.prompt_token_ids)
        assert g0.finish_reason == "length" and g0.error is None
    text = _get(actor.generate.remote("g-str", "hello there", GREEDY))
    assert len(text.outputs[0].token_ids) == GREEDY.max_tokens and text.prompt == "hello there"
    _assert_pages_free(actor)


def test_one_message_per_step_with_every_delta(actor: Any) -> None:
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    before = _get(actor.stats.remote()).num_steps
    ids = {f"m{i}" for i in range(4)}
    lens = _get([actor.submit.remote(f"m{i}", PROMPTS[i], params, consumer_id="steps") for i in range(4)])
    assert lens == [len(p) for p in PROMPTS[:4]]
    messages = _drain(actor, "steps", ids)
    after = _get(actor.stats.remote()).num_steps
    # Prompts fit in one step, so every step sampled for this consumer: one message each.
    assert len(messages) == after - before
    steps = [m.first_step for m in messages]
    assert steps == sorted(set(steps)) and all(m.first_step == m.last_step for m in messages)
    assert max(len({d.request_id for d in m.deltas}) for m in messages) >= 2
    assert all(len(t) == params.max_tokens for t in _tokens(messages).values())
    last = [d for m in messages for d in m.deltas if d.finish_reason is not None]
    assert len(last) == 4 and all(d.timing is not None and d.timing.ttft_s is not None for d in last)


def test_abort_mid_stream_frees_every_page(faulty: tuple[Any, Any]) -> None:
    actor, control = faulty
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    step = _get(actor.stats.remote()).num_steps
    _get(control.plan_.remote(step + 3, "hold"))  # a0 has 2 tokens, a1 has 1, both running
    _submit_held(actor, control, ["a0", "a1"], params, "abort")
    assert _get(control.wait.remote(f"hold-{step + 3}/in"))
    assert _get(actor.stats.remote()).num_running == 2
    # Abort while that step's forward is still running: pages come back at once.
    assert _get([actor.abort.remote("a0"), actor.abort.remote("a1")]) == [True, True]
    assert _get(actor.abort.remote("a0")) is False
    _assert_pages_free(actor)
    _get(control.set.remote(f"hold-{step + 3}/out"))
    messages = _drain(actor, "abort", {"a0", "a1"})
    assert {r: d.finish_reason for r, d in _ends(messages).items()} == {"a0": "abort", "a1": "abort"}
    assert {r: len(t) for r, t in _tokens(messages).items()} == {"a0": 2, "a1": 1}
    _assert_pages_free(actor)


def test_stats_and_validation(actor: Any) -> None:
    shared = list(range(10, 50))  # 40 tokens: two full pages cached after the first run
    _get(actor.generate.remote("s0", shared, GREEDY))
    _get(actor.generate.remote("s1", shared + [7], GREEDY))
    s = _get(actor.stats.remote())
    assert s.num_kv_pages_total == ENGINE["num_kv_pages"] and s.num_steps > 0
    assert 0.0 < s.prefix_cache_hit_rate <= 1.0
    assert 0.0 < s.ttft_ms_p50 <= s.ttft_ms_p95 and 0.0 < s.tpot_ms_p50 <= s.tpot_ms_p95
    assert s.num_preemptions == 0 and s.num_kv_pages_used == s.num_kv_pages_total - s.num_kv_pages_free
    health = _get(actor.health.remote())
    assert health.ok and not health.restarting
    with pytest.raises(InvalidParameterError) as err:
        _get(actor.submit.remote("bad", PROMPTS[0], SamplingParams(max_tokens=500)))
    assert err.value.param == "max_tokens" and "exceeds max_model_len 128" in str(err.value)
    with pytest.raises(InvalidParameterError) as err:
        _get(actor.generate.remote("bad", [1, 99999], GREEDY))
    assert err.value.param == "prompt"
    _assert_pages_free(actor)


def test_executor_failure_fails_in_flight_then_restarts(faulty: tuple[Any, Any]) -> None:
    actor, control = faulty
    expected = _get(actor.generate.remote("before", PROMPTS[0], GREEDY)).outputs[0].token_ids
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    step = _get(actor.stats.remote()).num_steps
    _get(control.plan_.remote(step + 3, "executor"))  # after x0's prefill and x0+x1's step
    ids = {f"x{i}" for i in range(4)}  # two run, two wait (max_num_seqs=2)
    _submit_held(actor, control, sorted(ids), params, "fault")
    ends = _ends(_drain(actor, "fault", ids, deadline_s=10.0))
    assert set(ends) == ids
    assert all(d.finish_reason == "error" and "executor failed" in (d.error or "") for d in ends.values())
    assert _get(control.wait.remote("restart-1/in"))
    assert "shard 0 died" in _get(actor.health.remote()).message
    s = _get(actor.stats.remote())  # the KV pool died: the prefix cache is emptied too
    assert s.num_kv_pages_free == s.num_kv_pages_total
    _assert_restart_cycle(actor, control, expected)


def test_one_step_forward_error_fails_only_that_step(faulty: tuple[Any, Any]) -> None:
    actor, control = faulty
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    step = _get(actor.stats.remote()).num_steps
    _get(control.plan_.remote(step + 3, "forward"))
    # f0 prefills alone (held), f1 joins the next step, step 3 fails both; f2, f3 wait.
    ids = [f"f{i}" for i in range(4)]
    _submit_held(actor, control, ids, params, "forward")
    messages = _drain(actor, "forward", set(ids))
    ends = _ends(messages)
    assert [ends[r].finish_reason for r in ids] == ["error", "error", "length", "length"]
    assert "injected forward error" in (ends["f0"].error or "")
    tokens = _tokens(messages)
    assert [len(tokens.get(r, [])) for r in ids] == [2, 1, 12, 12]
    assert _get(actor.health.remote()).ok
    _assert_pages_free(actor)


def test_killed_ray_shard_fails_in_flight_then_restarts(cluster: None, config: EngineConfig) -> None:
    actor, control = _faulty_actor(config, executor="ray", tensor_parallel_size=1)
    try:
        expected = _get(actor.generate.remote("warm", PROMPTS[0], GREEDY)).outputs[0].token_ids
        params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
        step = _get(actor.stats.remote()).num_steps
        _get(control.plan_.remote(step + 3, "hold"))  # both requests have streamed by then
        for i in range(2):
            _get(actor.submit.remote(f"k{i}", PROMPTS[i], params, consumer_id="kill"))
        assert _get(control.wait.remote(f"hold-{step + 3}/in"))
        (shard,) = _get(control.shards_.remote())
        ray.kill(shard, no_restart=True)
        _get(control.set.remote(f"hold-{step + 3}/out"))
        ends = _ends(_drain(actor, "kill", {"k0", "k1"}, deadline_s=10.0))
        assert [d.finish_reason for d in ends.values()] == ["error", "error"]
        assert all("executor failed" in (d.error or "") for d in ends.values())
        _assert_restart_cycle(actor, control, expected)
    finally:
        ray.get(actor.shutdown.remote(), timeout=TIMEOUT)
        ray.kill(actor)


def test_silent_consumer_requests_are_aborted(config: EngineConfig) -> None:
    """In process (no Ray): a consumer that never polls loses its requests, pages freed."""
    from actors.scheduler.actor import SchedulerService

    async def scenario() -> tuple[Any, Any]:
        svc = SchedulerService(config, consumer_timeout_s=0.0)  # every consumer is silent at once
        await svc.submit("ghost", PROMPTS[0], SamplingParams(max_tokens=50), consumer_id="gone")
        out = await asyncio.wait_for(svc.generate("kept", PROMPTS[1], GREEDY), TIMEOUT)  # no consumer
        stats = await svc.stats()
        await svc.shutdown()
        return out, stats

    out, s = asyncio.run(scenario())
    assert out.outputs[0].finish_reason == "length" and s.num_unfinished_requests == 0
    assert s.num_kv_pages_locked == 0 and s.num_kv_pages_free + s.num_kv_pages_evictable == s.num_kv_pages_total


@ray.remote
def _threads_in_ray() -> tuple[float, int]:
    from actors.remote.cpu_threads import engine_cpu_threads, ray_reserved_cpus

    return ray_reserved_cpus(), engine_cpu_threads(None)


def test_cpu_threads_follow_the_ray_reservation(cluster: None) -> None:
    """Whole reserved CPUs set the thread count; a fractional or empty reservation means every core."""
    from actors.remote.cpu_threads import usable_cores

    assert _get(_threads_in_ray.options(num_cpus=2).remote()) == (2.0, 2)
    reserved, threads = _get(_threads_in_ray.options(num_cpus=0.5).remote())
    assert reserved == 0.5 and threads == usable_cores()
