"""The scheduler actor on a local Ray cluster when a step fails between its planning and its update.

A token-mask build that raises ends that step's requests with an error, and a
step that fails as it finishes ends every request; either way the replica then
serves on, health ok. A failure the engine cannot settle turns health not ok,
and the actor still answers (its loop never holds the event loop).
Faults are injected into the live actor (``tests.actors.step_faults``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import ray

from actors.config import EngineConfig
from actors.scheduler.actor import SchedulerActor
from scheduling.sampling_params import SamplingParams
from scheduling.structured_output import StructuredOutput
from tests.actors.checkpoints import write_llama_with_tokenizer
from tests.actors.step_faults import (
    FINISH_ERROR,
    MASKS_ERROR,
    break_finish,
    break_masks,
    break_settling,
)

pytestmark = pytest.mark.ray  # on the session's shared cluster: run with the other Ray modules, last (tests/conftest.py)

ENGINE: dict[str, Any] = {"max_model_len": 128, "max_num_seqs": 8, "max_num_batched_tokens": 256,
                          "dtype": "float32", "device": "cpu", "num_kv_pages": 64}
PROMPT = [5 + (j * 7) % 200 for j in range(40)]  # two full pages and a part
CHOICE = StructuredOutput.choice(["alpha", "beta"], param="structured_outputs.choice")
CONSTRAINED = SamplingParams(max_tokens=12, temperature=0.0, structured_output=CHOICE)
FREE = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
TIMEOUT_S = 30.0
STARTUP_TIMEOUT_S = 300.0  # the first actor of a session may build the native CPU kernels


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> EngineConfig:
    return EngineConfig(model=str(write_llama_with_tokenizer(tmp_path_factory.mktemp("actor_faults"))), **ENGINE)


@pytest.fixture
def actor(ray_cluster: None, config: EngineConfig) -> Iterator[Any]:
    """A fresh scheduler actor per test (each test breaks its own); killed after."""
    handle = SchedulerActor.remote(config)
    try:
        assert ray.get(handle.health.remote(), timeout=STARTUP_TIMEOUT_S).ok
        yield handle
    finally:
        ray.kill(handle, no_restart=True)


def _get(ref: Any) -> Any:
    return ray.get(ref, timeout=TIMEOUT_S)


def _assert_all_free(actor: Any) -> None:
    s = _get(actor.stats.remote())
    assert s.num_kv_pages_free + s.num_kv_pages_evictable == s.num_kv_pages_total, s
    assert s.num_kv_pages_locked == 0 and s.num_running == 0 and s.num_waiting == 0, s
    assert s.num_unfinished_requests == 0, s


def test_a_mask_build_that_raises_fails_its_step_and_the_replica_serves_on(actor: Any) -> None:
    _get(actor.__ray_call__.remote(break_masks, 1))
    failed = _get(actor.generate.remote("broken", PROMPT, CONSTRAINED)).outputs[0]
    assert failed.finish_reason == "error" and MASKS_ERROR in (failed.error or ""), failed
    assert _get(actor.health.remote()).ok
    _assert_all_free(actor)
    # The scheduler steps again: a constrained and a free request both complete.
    constrained, free = _get([actor.generate.remote("after", PROMPT, CONSTRAINED),
                              actor.generate.remote("free", PROMPT, FREE)])
    assert constrained.outputs[0].text in ("alpha", "beta") and constrained.outputs[0].finish_reason == "stop"
    assert free.outputs[0].finish_reason == "length" and len(free.outputs[0].token_ids) == FREE.max_tokens
    assert _get(actor.health.remote()).ok
    _assert_all_free(actor)


def test_a_step_that_fails_before_its_update_ends_the_requests_and_the_replica_serves_on(actor: Any) -> None:
    _get(actor.__ray_call__.remote(break_finish, 1))
    failed = _get(actor.generate.remote("broken", PROMPT, FREE)).outputs[0]
    assert failed.finish_reason == "error" and FINISH_ERROR in (failed.error or ""), failed
    assert _get(actor.health.remote()).ok
    _assert_all_free(actor)
    after = _get(actor.generate.remote("after", PROMPT, FREE)).outputs[0]
    assert after.finish_reason == "length" and len(after.token_ids) == FREE.max_tokens
    assert _get(actor.health.remote()).ok
    _assert_all_free(actor)


def test_a_step_that_cannot_be_settled_turns_health_not_ok_and_the_actor_still_answers(actor: Any) -> None:
    _get(actor.__ray_call__.remote(break_masks, 1))
    _get(actor.__ray_call__.remote(break_settling))
    failed = _get(actor.generate.remote("broken", PROMPT, CONSTRAINED)).outputs[0]
    assert failed.finish_reason == "error" and MASKS_ERROR in (failed.error or ""), failed
    health = _get(actor.health.remote())
    assert not health.ok and "cannot plan another step" in health.message, health
    _assert_all_free(actor)
    # Submit, abort and health are still served; a request that arrives ends at once, saying why.
    later = _get(actor.generate.remote("later", PROMPT, FREE)).outputs[0]
    assert later.finish_reason == "error" and "cannot plan another step" in (later.error or ""), later
    assert _get(actor.abort.remote("later")) is False
    assert not _get(actor.health.remote()).ok
    _assert_all_free(actor)
