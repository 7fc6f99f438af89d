"""The Ray executor on a real local cluster: TP=2 over gloo against TP=1 and HF, faults, placement.

One local Ray cluster serves the whole module (starting one costs seconds on
a small machine). Every engine started here is shut down by its test.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import ray
from ray.exceptions import RayActorError
from transformers import PretrainedConfig

from actors.config import EngineConfig
from actors.errors import ExecutorFailure
from actors.load.embedded import build_tokenizer
from actors.remote.ray_executor import PlacementError, RayExecutor
from apps.llm import LLM
from scheduling.errors import InvalidParameterError
from scheduling.pooling import Pooling
from scheduling.sampling_params import SamplingParams
from tests.actors.checkpoints import (
    build_hf_model,
    hf_greedy,
    llama_config,
    qwen2_config,
    write_checkpoint,
)
from tests.actors.engine.test_embeddings import TOL, hf_embedding, max_error
from tests.actors.lora_fixtures import PROJECTION_SETS, make_peft_adapter

pytestmark = pytest.mark.ray  # on the session's shared cluster: run with the other Ray modules, last (tests/conftest.py)

MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
# llama: GQA, 2 KV heads split 1 per rank; qwen2: MQA, its 1 KV head replicated on both ranks.
CASES: dict[str, tuple[Callable[[], PretrainedConfig], int]] = {
    "llama_gqa": (llama_config, 0),
    "qwen2_mqa": (qwen2_config, 1),
}
ENGINE: dict[str, Any] = {"max_model_len": 128, "max_num_seqs": 8, "max_num_batched_tokens": 256,
                          "num_kv_pages": 64, "dtype": "float32", "device": "cpu"}


def _prompts() -> list[list[int]]:
    """Six prompts, four of them sharing a 20-token prefix (a prefix-cache hit on the ranks)."""
    rng = random.Random(11)
    shared = [rng.randrange(3, 256) for _ in range(20)]
    return [
        (shared if i % 3 else []) + [rng.randrange(3, 256) for _ in range(rng.randint(3, 30))]
        for i in range(6)
    ]


PROMPTS = _prompts()


_BUILT: dict[str, tuple[Path, list[list[int]]]] = {}


def _case(name: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]]]:
    """A seeded checkpoint folder (with tokenizer) and HF ``generate``'s greedy tokens; built once."""
    if name not in _BUILT:
        make_config, seed = CASES[name]
        folder = write_checkpoint(tmp_path_factory.mktemp(name), make_config(), seed=seed)
        build_tokenizer().save_pretrained(folder)
        hf = build_hf_model(make_config(), seed)
        _BUILT[name] = folder, [hf_greedy(hf, p, MAX_TOKENS) for p in PROMPTS]
    return _BUILT[name]


@pytest.fixture(scope="module", params=list(CASES))
def oracle_case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]]]:
    return _case(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def llama_case(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]]]:
    """The GQA case alone: the fault and error paths need one architecture, not two."""
    return _case("llama_gqa", tmp_path_factory)


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _assert_pool_clean(llm: LLM) -> None:
    """Every KV page is free once the prefix cache lets go of its pages."""
    sched = llm.engine.policy
    if sched.cache is not None:
        assert sched.cache.num_locked_pages == 0
        sched.cache.reset()
    sched.allocator.check_integrity()
    assert sched.allocator.num_free_pages == sched.allocator.num_pages


def test_config_accepts_ray_tensor_parallel_and_names_bad_values() -> None:
    assert EngineConfig(executor="ray", tensor_parallel_size=2).placement_strategy == "PACK"
    with pytest.raises(InvalidParameterError, match="executor='ray'") as err:
        EngineConfig(tensor_parallel_size=2)
    assert err.value.param == "tensor_parallel_size"
    with pytest.raises(InvalidParameterError, match="STRICT_SPREAD.*'RING'") as err:
        EngineConfig(executor="ray", placement_strategy="RING")
    assert err.value.param == "placement_strategy"


def test_tp2_matches_tp1_and_hf(ray_cluster: None, oracle_case: tuple[Path, list[list[int]]]) -> None:
    folder, expected = oracle_case
    local = LLM(str(folder), **ENGINE)
    assert _tokens(local) == expected
    llm = LLM(str(folder), tensor_parallel_size=2, executor="ray", **ENGINE)
    try:
        infos = llm.engine.executor.shard_infos  # type: ignore[attr-defined]
        assert [i.rank for i in infos] == [0, 1] and infos[0].pid != infos[1].pid
        assert llm.engine.executor.capacity.num_pages == local.engine.executor.capacity.num_pages == 64
        assert _tokens(llm) == expected
        again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)  # now through the prefix cache
        assert [o.outputs[0].token_ids for o in again] == expected
        assert sum(o.num_cached_tokens for o in again) > 0
        _assert_pool_clean(llm)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("method", ["ngram", "self_draft", "draft_model"])
def test_tp2_with_speculation_matches_hf(
    ray_cluster: None, llama_case: tuple[Path, list[list[int]]], method: str
) -> None:
    """Drafts verified across two ranks; a drafter's forward runs on both (rank 0's tokens broadcast)."""
    folder, expected = llama_case
    spec: dict[str, Any] = {
        "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
        "self_draft": {"method": "draft", "layers": 1, "num_speculative_tokens": 3},
        "draft_model": {"method": "draft", "model": str(folder), "num_speculative_tokens": 3},
    }[method]
    llm = LLM(str(folder), tensor_parallel_size=2, executor="ray", **ENGINE,
              speculative_config={**spec, "busy_min_acceptance": 0.0})
    try:
        assert _tokens(llm) == expected
        stats = llm.engine.policy.stats
        assert stats.spec_num_drafts > 0
        if method == "draft_model":  # the target drafting for itself: every greedy draft is right
            assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
        _assert_pool_clean(llm)
    finally:
        llm.shutdown()


def test_tp2_embeddings_match_hf_beside_generation(ray_cluster: None, llama_case: tuple[Path, list[list[int]]]) -> None:
    """Pooled rows come from rank 0 (the hidden states are whole on every rank after the all-reduce),
    chunked (16-token budget) and in steps shared with generating sequences."""
    folder, expected = llama_case
    hf = build_hf_model(llama_config(), 0)
    llm = LLM(str(folder), tensor_parallel_size=2, executor="ray", **{**ENGINE, "max_num_batched_tokens": 16})
    try:
        poolings = [Pooling("last"), Pooling("mean", normalize=False)]
        params = [GREEDY] * len(PROMPTS) + [SamplingParams(pooling=p) for p in poolings]
        outs = llm.generate([*PROMPTS, PROMPTS[1], PROMPTS[1]], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs[: len(PROMPTS)]] == expected
        for out, pooling in zip(outs[len(PROMPTS):], poolings, strict=True):
            got = out.outputs[0].embedding
            assert got is not None and max_error(got, hf_embedding(hf, PROMPTS[1], pooling)) < TOL
        _assert_pool_clean(llm)
    finally:
        llm.shutdown()


def test_killed_shard_fails_the_next_step_and_restart_recovers(
    ray_cluster: None, llama_case: tuple[Path, list[list[int]]]
) -> None:
    """Rank 1 dies (rank 0 would wait in a collective), then rank 0 dies (the reverse)."""
    folder, expected = llama_case
    llm = LLM(str(folder), tensor_parallel_size=2, executor="ray", **{**ENGINE, "device": "auto"})
    executor = llm.engine.executor
    assert isinstance(executor, RayExecutor)
    assert executor.config.device == "cpu"  # "auto" resolved from the cluster: it has no GPU
    try:
        assert _tokens(llm)[:2] == expected[:2]
        for victim in (1, 0):
            shard = executor.shards[victim]
            old_pids = {i.pid for i in executor.shard_infos}
            ray.kill(shard, no_restart=True)
            _wait_until_dead(shard)
            start = time.monotonic()
            with pytest.raises(ExecutorFailure, match=f"shard rank {victim} failed"):
                llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
            assert time.monotonic() - start < 10
            assert executor.shards == []  # the survivor, maybe stuck in a collective, is gone too
            with pytest.raises(ExecutorFailure, match="restart"):
                llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
            # The KV pages died with the shards: cached prefixes must go (the engine's job on failure).
            _assert_pool_clean(llm)
            executor.restart()
            assert {i.pid for i in executor.shard_infos}.isdisjoint(old_pids)
            assert executor.capacity.num_pages == 64
            assert _tokens(llm) == expected
            _assert_pool_clean(llm)
    finally:
        llm.shutdown()
    assert executor.shards == []
    _assert_no_placement_group()


def test_unplaceable_group_is_a_clear_error(ray_cluster: None) -> None:
    config = EngineConfig(executor="ray", tensor_parallel_size=8, **ENGINE)  # 8 CPUs; the cluster has 4
    with pytest.raises(PlacementError, match=r"8 bundles of \{'CPU': 1.0\} with strategy PACK"):
        RayExecutor(config, placement_timeout_s=1.0)
    _assert_no_placement_group()


def _wait_until_dead(actor: Any, timeout_s: float = 10.0) -> None:
    """Block until calls to ``actor`` fail: ``ray.kill`` returns before the kill lands."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:  # each ping is one round trip: ms while the actor lives
        try:
            ray.get(actor.ping.remote(), timeout=timeout_s)
        except RayActorError:
            return
    raise AssertionError(f"actor still answers {timeout_s} s after ray.kill")


def _assert_no_placement_group() -> None:
    """Every placement group this module made has been removed (its shards with it)."""
    states = {pg["state"] for pg in ray.util.placement_group_table().values()}
    assert states <= {"REMOVED"}, states


def test_shard_start_error_is_the_user_error(ray_cluster: None, llama_case: tuple[Path, list[list[int]]]) -> None:
    """Three ranks cannot split four query heads: the loader's error reaches the caller as itself."""
    folder, _ = llama_case
    with pytest.raises(InvalidParameterError, match="divisible") as err:
        LLM(str(folder), tensor_parallel_size=3, executor="ray", **ENGINE)
    assert err.value.param == "tensor_parallel_size"
    _assert_no_placement_group()


def test_tp2_lora_matches_tp1(ray_cluster: None, llama_case: tuple[Path, list[list[int]]], tmp_path: Path) -> None:
    """LoRA on every projection split like its base layer: a mixed batch on two shards equals one shard's.

    A refused adapter (its path missing) leaves the group up and registers nothing.
    """
    folder, _ = llama_case
    adapter = make_peft_adapter(folder, tmp_path / "all", targets=PROJECTION_SETS["all"], rank=8, alpha=16, seed=5)
    params = [replace(GREEDY, lora="task" if i % 2 else None) for i in range(len(PROMPTS))]
    lora = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8}
    local = LLM(str(folder), **ENGINE, **lora)
    local.load_lora("task", str(adapter))
    want = [o.outputs[0].token_ids for o in local.generate(PROMPTS, params, use_tqdm=False)]
    assert want != _tokens(local)  # the adapter shows
    llm = LLM(str(folder), tensor_parallel_size=2, executor="ray", **ENGINE, **lora)
    try:
        with pytest.raises(InvalidParameterError) as err:
            llm.load_lora("task", str(tmp_path / "missing"))
        assert err.value.param == "lora_path" and llm.engine.loras.adapters == {}
        llm.load_lora("task", str(adapter))
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)] == want
        _assert_pool_clean(llm)
    finally:
        llm.shutdown()
