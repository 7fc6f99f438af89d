"""Faults on a real local Ray cluster: killed replicas, schedulers and shards, a failing forward,
KV exhaustion. Each test ends with every KV page free (on the new actor where one was replaced)
and the next request succeeding; every wait is bounded.

These tests break things, so they get their own Serve application ("faults", at ``/faults``,
scheduler actor ``faults-scheduler``) beside the package's shared ``live`` one on the same Ray
cluster (one cluster per process): the shared app is never touched. The application runs the
``ray`` executor (the replica's SchedulerActor drives a ModelShardActor, so a shard can be
killed), a small KV pool (so load preempts) and a 1 s health-check period (so a replica whose
scheduler died is replaced in seconds).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
from ray.util import placement_group_table, remove_placement_group

from apps.llm import LLM
from flotilla import Client
from flotilla.errors import APIConnectionError, APIStatusError
from scheduling.sampling_params import SamplingParams
from tests.actors.fault_injection import (
    NEXT_STEP,
    Signals,
    install_faults,
    replica_actors,
    shard_handles,
    side_app,
    wait_dead,
)
from tests.serve_harness import ACTOR_NAMESPACE, LiveServer, http, poll_until

pytestmark = pytest.mark.ray  # on the session's shared cluster: run with the other Ray modules, last (tests/conftest.py)

APP = "faults"
DEADLINE_S = 180.0  # bound of every wait (a replacement starts 2-3 processes; CI boxes are slow)
LONG = {"max_tokens": 200, "ignore_eos": True, "temperature": 0.0}  # fits max_model_len below
RETRIED = "retried after the kill"  # the prompt of the stream the replica kill must retry


@pytest.fixture(scope="module")
def faults(live: LiveServer, tiny_model_dir: Path) -> Iterator[LiveServer]:
    # replica_options num_cpus 0: the 4-CPU cluster then has room for a leaked shard group
    # (the kill tests fail on it, then remove it) beside the live app's replica and this app's shard.
    with side_app(live.url, APP, str(tiny_model_dir), health_check_period_s=1.0, executor="ray",
                  max_model_len=256, max_num_seqs=8, num_kv_pages=24,
                  replica_options={"num_cpus": 0}) as app:
        yield app
    live.assert_pages_free()  # the shared app was never disturbed


@pytest.fixture
def sdk(faults: LiveServer) -> Iterator[Client]:
    with Client(faults.url, timeout=DEADLINE_S, max_retries=0) as client:
        yield client


def _scheduler(app: LiveServer) -> Any:
    return ray.get_actor(app.actor_name, namespace=ACTOR_NAMESPACE)


def _until(what: str, check: Callable[[], bool], timeout_s: float = DEADLINE_S) -> None:
    """Poll ``check`` (each call a round trip to the cluster) with backoff until true, at most ``timeout_s``."""
    poll_until(check, timeout_s, what)


def _replica_id(app_name: str = APP) -> str | None:
    replicas = replica_actors(app_name)
    return replicas[0]._actor_id.hex() if len(replicas) == 1 else None


def _healthy_again(app: LiveServer, old_replica: str | None, timeout_s: float = DEADLINE_S) -> None:
    """A new replica serves (its scheduler answers /health): bounded, never a sleep."""
    def replaced() -> bool:
        new = _replica_id()
        if new is None or new == old_replica:
            return False
        try:
            return http(f"{app.url}/health")[0] == 200
        except OSError:
            return False
    _until("the replica to be replaced", replaced, timeout_s)


def _shard_group(app: LiveServer) -> Any:
    """The placement group of the app's scheduler's shards."""
    def group(service: Any) -> Any:
        executor = service._engine.executor
        return getattr(executor, "inner", executor)._pg  # under an InjectedExecutor, the real one

    return ray.get(_scheduler(app).__ray_call__.remote(group))


@contextlib.contextmanager
def _group_released(group: Any) -> Iterator[None]:
    """After the block (a replacement served): the killed scheduler's shard group no longer holds its CPUs.

    Ray ties a placement group to its creator actor AND job, so a dead scheduler's group
    outlives it unless flotilla removes it. A leaked group is removed before failing, so the
    cluster is whole again for the tests that follow.
    """
    yield
    state = placement_group_table(group)["state"]
    if state != "REMOVED":
        remove_placement_group(group)
    assert state == "REMOVED", f"the killed scheduler's shard group is {state}: it still reserves CPUs/GPUs"


def _ends_ok(app: LiveServer) -> None:
    """Every page free on the (maybe new) scheduler, and the next request succeeds."""
    app.assert_pages_free(20.0)
    status, body = http(f"{app.url}/v1/completions", {"prompt": "after", "max_tokens": 4})
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 4
    app.assert_pages_free(20.0)


def _stream_until_first_token(client: Client, prompt: str) -> Any:
    stream = client.stream(prompt, **LONG)
    next(stream)
    return stream


def _drain(stream: Any) -> BaseException | None:
    """Read a stream to its end: the error it ended with, or None if it finished."""
    try:
        for _ in stream:
            pass
    except (APIConnectionError, APIStatusError) as err:
        return err
    finally:
        stream.close()
    return None


def test_forward_error_fails_only_its_step(faults: LiveServer, sdk: Client) -> None:
    control = Signals.remote()  # type: ignore[attr-defined]
    ray.get(_scheduler(faults).__ray_call__.remote(install_faults, control))
    old = _replica_id()
    victim = _stream_until_first_token(sdk, "in the failing step")
    ray.get(control.plan_.remote(NEXT_STEP, "hold-forward:fwd"))
    ray.get(control.wait.remote("fwd/in"))  # the failing step is in flight, the victim in it
    with cf.ThreadPoolExecutor(1) as pool:
        later = pool.submit(http, f"{faults.url}/v1/completions", {"prompt": "queued meanwhile", "max_tokens": 6})
        _until("the later request to queue", lambda: faults.stats().num_unfinished_requests == 2)
        ray.get(control.set.remote("fwd/out"))
        err = _drain(victim)
        assert isinstance(err, APIStatusError) and err.status == 500, err
        assert "injected forward error" in err.message, err.message
        status, body = later.result(DEADLINE_S)
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 6
    assert http(f"{faults.url}/health")[0] == 200
    assert _replica_id() == old
    _ends_ok(faults)


def test_kv_exhaustion_preempts_and_matches_offline(faults: LiveServer, sdk: Client, tiny_llm: LLM) -> None:
    """8 requests need ~40 pages of a 24-page pool: preemption + recompute, same greedy text."""
    prompts = [f"request number {i}: tell me about the sea" for i in range(8)]
    params = {"max_tokens": 48, "ignore_eos": True, "temperature": 0.0}
    before = faults.stats().num_preemptions
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        done = list(pool.map(lambda p: sdk.complete(p, **params), prompts, timeout=DEADLINE_S))
    assert faults.stats().num_preemptions > before, "the pool was meant to run out"
    offline = tiny_llm.generate(prompts, SamplingParams(max_tokens=48, ignore_eos=True, temperature=0.0),
                                use_tqdm=False)
    assert [d.text for d in done] == [o.outputs[0].text for o in offline]
    _ends_ok(faults)



def test_shard_kill_under_load(faults: LiveServer, sdk: Client) -> None:
    """Every in-flight request completes or ends in a clear error; the executor restarts in place."""
    old = _replica_id()
    [shard] = ray.get(_scheduler(faults).__ray_call__.remote(shard_handles))
    with cf.ThreadPoolExecutor(4) as pool:
        streams = [_stream_until_first_token(sdk, f"load {i}") for i in range(4)]
        ray.kill(shard, no_restart=True)
        wait_dead(shard)
        errors = list(pool.map(_drain, streams, timeout=DEADLINE_S))
    failed = [e for e in errors if e is not None]
    assert failed, "a killed shard must fail the requests of its step"
    for err in failed:
        assert isinstance(err, APIStatusError) and err.status == 500, err
        assert "executor failed" in err.message, err.message
    _until("the executor to restart", lambda: http(f"{faults.url}/health")[0] == 200)
    assert _replica_id() == old, "a shard failure must not cost the replica"
    [new_shard] = ray.get(_scheduler(faults).__ray_call__.remote(shard_handles))
    assert new_shard._actor_id != shard._actor_id
    _ends_ok(faults)


def test_replica_kill_mid_stream(faults: LiveServer, sdk: Client, tiny_llm: LLM) -> None:
    """A stream with tokens ends in a clear error; one with none yet is retried on the new replica."""
    control = Signals.remote()  # type: ignore[attr-defined]
    ray.get(_scheduler(faults).__ray_call__.remote(install_faults, control))
    old, group = _replica_id(), _shard_group(faults)
    assert old is not None
    # The retried stream must give the whole greedy answer once: not a prefix, not tokens twice.
    [want] = tiny_llm.generate([RETRIED], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    with _group_released(group):
        _kill_replica_mid_stream(faults, sdk, control, old, want.outputs[0].text)


def _kill_replica_mid_stream(faults: LiveServer, sdk: Client, control: Any, old: str, want: str) -> None:
    started = _stream_until_first_token(sdk, "killed mid-stream")
    # Hold the next step, so a second stream is queued with no token when the replica dies.
    ray.get(control.plan_.remote(NEXT_STEP, "hold:replica"))
    ray.get(control.wait.remote("replica/in"))
    with Client(faults.url, timeout=DEADLINE_S, max_retries=6, backoff_base=0.5,
                backoff_cap=4.0) as retrying, cf.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(lambda: _drain_text(retrying.stream(RETRIED, max_tokens=8, temperature=0.0)))
        _until("the second request to reach the scheduler",
               lambda: faults.stats().num_unfinished_requests == 2)
        [replica] = replica_actors(APP)
        ray.kill(replica, no_restart=True)
        wait_dead(replica)
        err = _drain(started)
        assert isinstance(err, (APIConnectionError, APIStatusError)), "a killed stream must end in an error"
        text, attempts = pending.result(DEADLINE_S)
        assert attempts >= 2, "the request with no token yet should have been retried"
        assert text == want, (text, want)
    _healthy_again(faults, old)
    _ends_ok(faults)


def _drain_text(stream: Any) -> tuple[str, int]:
    with stream:
        text = "".join(d.text for d in stream)
        return text, stream.num_attempts


def test_scheduler_kill_fails_in_flight_and_replaces_replica(faults: LiveServer, sdk: Client) -> None:
    old, group = _replica_id(), _shard_group(faults)
    with _group_released(group):
        streaming = _stream_until_first_token(sdk, "scheduler dies")
        with cf.ThreadPoolExecutor(1) as pool:
            whole = pool.submit(http, f"{faults.url}/v1/completions", {"prompt": "whole", **LONG})
            _until("the JSON request to run", lambda: faults.stats().num_unfinished_requests == 2)
            scheduler = _scheduler(faults)
            ray.kill(scheduler, no_restart=True)
            wait_dead(scheduler)
            err = _drain(streaming)
            assert isinstance(err, APIStatusError) and err.status == 500, err
            assert "lost its scheduler" in err.message
            status, body = whole.result(DEADLINE_S)
            assert status == 500 and "lost its scheduler" in body["error"]["message"], body
        # Until Serve replaces it, the replica still takes requests: each must get a clear answer,
        # a 503 naming the engine (a 200 came from the successor: nothing to judge then).
        status, body = http(f"{faults.url}/v1/completions", {"prompt": "meanwhile", "max_tokens": 2})
        if status != 200:
            assert status == 503, body
            assert "scheduler" in body["error"]["message"] or "engine" in body["error"]["message"], body
        _healthy_again(faults, old)  # check_health failed: Serve replaced the replica
        _ends_ok(faults)


def _break_restarts(service: Any) -> None:
    """Run in a SchedulerActor: from now on its executor cannot be restarted."""
    service._engine.executor.restart = _restart_fails


def _restart_fails() -> None:
    raise RuntimeError("no device left (injected)")


def test_replica_whose_executor_cannot_restart_is_replaced(faults: LiveServer, sdk: Client) -> None:
    """The executor fails and its restart fails too: the health check fails and Serve replaces the replica."""
    control = Signals.remote()  # type: ignore[attr-defined]
    scheduler = _scheduler(faults)
    ray.get(scheduler.__ray_call__.remote(install_faults, control))
    ray.get(scheduler.__ray_call__.remote(_break_restarts))
    old = _replica_id()
    ray.get(control.plan_.remote(NEXT_STEP, "executor"))
    status, body = http(f"{faults.url}/v1/completions", {"prompt": "breaks the executor", "max_tokens": 4})
    assert status == 500 and "executor failed" in body["error"]["message"], body
    _until("the restart to fail", lambda: "restart failed" in str(ray.get(scheduler.health.remote()).message), 30.0)
    _healthy_again(faults, old, timeout_s=60.0)  # the old replica, left in rotation, would fail every request
    _ends_ok(faults)
