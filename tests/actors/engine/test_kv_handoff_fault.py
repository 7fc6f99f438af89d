"""Prefill/decode disaggregation on real Ray actors when the prefill replica dies mid-transfer (after it handed
out its result, before the decode replica fetched the KV): the decode replica fails fast with ``OwnerDiedError``
and takes no page, and a retry on another prefill replica decodes the colocated greedy tokens."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import pytest
import ray
from ray.exceptions import GetTimeoutError, OwnerDiedError, RayActorError, RayTaskError

from actors.api import EngineStats, PrefillResult
from actors.config import EngineConfig
from actors.scheduler.actor import SchedulerActor, SchedulerService
from tests.actors.checkpoints import write_llama_with_tokenizer
from tests.actors.engine.test_kv_handoff import ENGINE, GREEDY, PROMPTS, assert_all_free

pytestmark = pytest.mark.ray  # on the session's shared cluster: run with the other Ray modules, last (tests/conftest.py)

PROMPT = PROMPTS[-1]  # 102 tokens: chunked prefill, several KV pages
REQUEST_ID = "m"
CONSUMER = "pd"
TIMEOUT_S = 60.0  # ordinary calls
# Actor start-up: the first actors of a process tree may build the native CPU kernels (kvcache.cpu_kernels),
# a minute or more on 2 busy cores.
STARTUP_TIMEOUT_S = 300.0
HANDOFF_TIMEOUT_S = 10.0  # the hand-over of a result whose owner is dead must fail well within this


@dataclass
class Replicas:
    prefill_dead: Any  # A: prefills, then is killed before the decode side fetches its KV
    prefill_retry: Any  # B: the replica the retry lands on
    decode: Any  # D


@dataclass
class FailedHandoff:
    result: PrefillResult  # A's result, its KV owned by the dead A
    error: BaseException | None
    elapsed_s: float
    decode_stats: EngineStats


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> EngineConfig:
    return EngineConfig(model=str(write_llama_with_tokenizer(tmp_path_factory.mktemp("pd_fault"))), **ENGINE)


@pytest.fixture(scope="module")
def replicas(ray_cluster: None, config: EngineConfig) -> Iterator[Replicas]:
    """Three scheduler actors, started together; every one killed at teardown."""
    started: list[Any] = []
    try:
        for _ in range(3):
            started.append(SchedulerActor.remote(config))
        ray.get([a.health.remote() for a in started], timeout=STARTUP_TIMEOUT_S)
        yield Replicas(*started)
    finally:
        for actor in started:
            ray.kill(actor, no_restart=True)


def wait_dead(actor: Any, timeout_s: float = TIMEOUT_S) -> None:
    """Poll ``actor`` until a call fails with ``RayActorError`` (``ray.kill`` returns before the kill lands)."""
    deadline = time.monotonic() + timeout_s
    backoff = 0.05
    while True:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=max(0.1, deadline - time.monotonic()))
        except RayActorError:
            return
        except GetTimeoutError:
            pass
        assert time.monotonic() < deadline, f"the actor still answers {timeout_s} s after ray.kill"
        time.sleep(backoff)
        backoff = min(2 * backoff, 0.5)


def wait_kv_lost(kv: Any, timeout_s: float = TIMEOUT_S) -> None:
    """Poll ``ray.get(kv)`` here until it raises ``OwnerDiedError``.

    The owner's death is not yet the KV's loss: the node's object store drops a
    dead owner's objects in its next batch of frees (about a second later), and
    until then a borrower on this node still reads them (a hand-over then simply
    succeeds). This process shares D's node, so once it cannot read the KV, D cannot.
    """
    deadline = time.monotonic() + timeout_s
    backoff = 0.05
    while True:
        try:
            value = ray.get(kv, timeout=HANDOFF_TIMEOUT_S)
        except OwnerDiedError:
            return
        del value  # readable still: release the store's buffers at once
        assert time.monotonic() < deadline, f"the KV is still readable {timeout_s} s after its owner died"
        time.sleep(backoff)
        backoff = min(2 * backoff, 0.5)


@pytest.fixture(scope="module")
def failed_handoff(replicas: Replicas) -> FailedHandoff:
    """A prefills the prompt and hands out its result; A is killed and its KV lost; then D is given that result."""
    a, d = replicas.prefill_dead, replicas.decode
    result: PrefillResult = ray.get(a.prefill.remote(f"{REQUEST_ID}.p0", PROMPT, GREEDY), timeout=TIMEOUT_S)
    assert isinstance(result.kv, ray.ObjectRef) and result.kv_bytes > 0  # owned by A (its ray.put)
    ray.kill(a, no_restart=True)
    wait_dead(a)
    wait_kv_lost(result.kv)
    start = time.monotonic()
    error: BaseException | None = None
    try:
        ray.get(d.submit_prefilled.remote(replace(result, request_id=REQUEST_ID), PROMPT, GREEDY, 0.0,
                                          consumer_id=CONSUMER), timeout=HANDOFF_TIMEOUT_S)
    except Exception as exc:  # asserted on by the tests
        error = exc
    elapsed = time.monotonic() - start
    return FailedHandoff(result, error, elapsed, ray.get(d.stats.remote(), timeout=TIMEOUT_S))


def test_kv_of_a_dead_prefill_replica_fails_fast_without_a_page(failed_handoff: FailedHandoff) -> None:
    err = failed_handoff.error
    assert not isinstance(err, GetTimeoutError), "the decode replica hangs on KV whose owner is dead"
    # Raised in D while it awaits the ref, so it arrives as D's task error, an instance of its cause too.
    assert isinstance(err, RayTaskError) and isinstance(err, OwnerDiedError), repr(err)
    assert failed_handoff.result.kv.hex() in str(err)
    assert failed_handoff.elapsed_s < HANDOFF_TIMEOUT_S
    assert failed_handoff.decode_stats.num_steps == 0  # nothing was admitted
    assert_all_free(failed_handoff.decode_stats)


def test_retry_on_another_prefill_replica_decodes_the_colocated_tokens(
    replicas: Replicas, failed_handoff: FailedHandoff, config: EngineConfig
) -> None:
    b, d = replicas.prefill_retry, replicas.decode
    result: PrefillResult = ray.get(b.prefill.remote(f"{REQUEST_ID}.p1", PROMPT, GREEDY), timeout=TIMEOUT_S)
    assert ray.get(d.submit_prefilled.remote(replace(result, request_id=REQUEST_ID), PROMPT, GREEDY, 0.0,
                                             consumer_id=CONSUMER), timeout=TIMEOUT_S) == len(PROMPT)
    got: list[int] = []
    reason: str | None = None
    deadline = time.monotonic() + TIMEOUT_S
    while reason is None:
        assert time.monotonic() < deadline, "the retried request did not finish"
        for message in ray.get(d.next_outputs.remote(CONSUMER, 1.0), timeout=TIMEOUT_S):
            for delta in message.deltas:
                assert delta.request_id == REQUEST_ID, delta
                got += delta.token_ids
                reason = reason or delta.finish_reason

    async def colocated() -> tuple[list[int], EngineStats]:
        service = SchedulerService(config)  # C, in process: the same engine with no hand-over
        try:
            out = await service.generate("c", PROMPT, GREEDY)
            return out.outputs[0].token_ids, await service.stats()
        finally:
            await service.shutdown()

    expected, colocated_stats = asyncio.run(colocated())
    assert reason == "length" and got == expected and len(got) == GREEDY.max_tokens
    for stats in (*ray.get([b.stats.remote(), d.stats.remote()], timeout=TIMEOUT_S), colocated_stats):
        assert_all_free(stats)
