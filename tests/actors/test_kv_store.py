"""The cluster KV tier on a real local Ray cluster: an engine that never saw a prompt starts from the blocks
another engine stored; a killed store actor ends in recompute with the same tokens and every page free, and the
next save starts a fresh store."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest
import ray
from ray.actor import ActorHandle

from actors.engine.llm_engine import LLMEngine
from actors.kv_store import NAMESPACE, RayBlockStore, app_of, store_scope
from apps.llm import LLM
from cli.main import main
from kvcache.kv_blocks import KEY_BYTES
from kvcache.kv_tiers import StoreState
from tests.actors.checkpoints import write_llama_with_tokenizer
from tests.actors.engine.test_kv_offload import (
    ENGINE,
    GREEDY,
    PROMPTS,
    _assert_all_free,
    _cached,
    _evict_all,
    _generate,
    _tier,
)
from tests.actors.lora_fixtures import PROJECTION_SETS, make_peft_adapter

pytestmark = pytest.mark.ray  # on the session's shared cluster: run with the other Ray modules, last (tests/conftest.py)

CLUSTER = {"cluster": True, "load_wait_s": 30.0}  # a busy CI box: a load never times out into a recompute here


def _store(engine: LLMEngine) -> ActorHandle:
    """This node's store of ``engine``'s app and model."""
    assert engine.kv_tiers is not None and engine.kv_tiers._store is not None
    return ray.get_actor(engine.kv_tiers._store._local_name(), namespace=NAMESPACE)


def _store_stats(engine: LLMEngine) -> dict[str, int]:
    return ray.get(_store(engine).stats.remote(), timeout=60)


def test_engines_share_blocks_through_the_cluster_store(ray_cluster: None, tmp_path: Path) -> None:
    model = str(write_llama_with_tokenizer(tmp_path / "model"))
    reference = _generate(LLM(model=model, **ENGINE), PROMPTS)

    first = LLM(model=model, kv_offload=CLUSTER, **ENGINE)
    assert _generate(first, PROMPTS) == reference
    assert first.engine.kv_tiers is not None
    first.engine.kv_tiers.wait_for_saves()
    held = _store_stats(first.engine)
    assert held["blocks"] > 0 and held["bytes"] <= held["max_bytes"]
    cluster = _tier(first.engine, "cluster")
    assert cluster["errors"] == 0
    # What the tier reports holding is what the store holds (it alone wrote there), and it wrote every byte.
    assert (cluster["blocks"], cluster["bytes"], cluster["bytes_written"]) == (held["blocks"], held["bytes"],
                                                                                held["bytes"])  # fmt: skip
    first.shutdown()

    # A new engine (a replica autoscaling just added) starts warm.
    second = LLM(model=model, kv_offload=CLUSTER, **ENGINE)
    tokens, cached = _cached(second, PROMPTS)
    assert tokens == reference
    assert cached == [(len(p) - 1) // 16 * 16 for p in PROMPTS]
    assert _tier(second.engine, "cluster")["hits"] == sum(cached) // 16
    _assert_all_free(second.engine)

    # The store dies under it: the engine recomputes, same tokens, every page free, the fault counted.
    ray.kill(_store(second.engine), no_restart=True)
    _evict_all(second.engine)
    hits_before = _tier(second.engine, "cluster")["hits"]
    tokens, cached = _cached(second, PROMPTS)
    # No block comes from the dead store: every lookup that reaches it is a miss and a counted error. (Which
    # request computes the shared head first, and so which ones reuse it from the radix cache, depends on when
    # each lookup ends; no order is assumed.)
    assert tokens == reference
    assert _tier(second.engine, "cluster")["hits"] == hits_before
    assert _tier(second.engine, "cluster")["errors"] >= 1
    _assert_all_free(second.engine)
    # Its saves of the recomputed pages start a fresh store on the node, from which a new engine starts warm.
    assert second.engine.kv_tiers is not None
    second.engine.kv_tiers.wait_for_saves()
    second.shutdown()
    third = LLM(model=model, kv_offload=CLUSTER, **ENGINE)
    tokens, cached = _cached(third, PROMPTS)
    assert tokens == reference and sum(cached) > 0
    _assert_all_free(third.engine)
    third.shutdown()


def test_two_shards_save_and_load_their_own_heads(ray_cluster: None, tmp_path: Path) -> None:
    """With tensor_parallel_size 2 each rank copies out and loads back its own share of the KV heads (blocks
    hold both ranks' halves): evicted pages come back from host memory with the same greedy tokens."""
    model = str(write_llama_with_tokenizer(tmp_path / "model"))
    reference = _generate(LLM(model=model, **ENGINE), PROMPTS)
    llm = LLM(model=model, tensor_parallel_size=2, executor="ray", kv_offload={"host_bytes": 1 << 26}, **ENGINE)
    assert _generate(llm, PROMPTS) == reference
    _evict_all(llm.engine)
    tokens, cached = _cached(llm, PROMPTS)
    assert tokens == reference and cached == [(len(p) - 1) // 16 * 16 for p in PROMPTS]
    _assert_all_free(llm.engine)
    llm.shutdown()


def _stores_of(app: str) -> list[str]:
    return [e["name"] for e in ray.util.list_named_actors(all_namespaces=True)
            if e["namespace"] == NAMESPACE and app_of(e["name"]) == app]  # fmt: skip


def test_stores_are_per_app_and_model_and_dropped_by_app(ray_cluster: None, capsys: pytest.CaptureFixture[str]) -> None:
    """Another app, or another model of the same app, neither sees nor evicts an app's blocks; ``flotilla kv
    drop --app`` ends that app's stores only. A put reports what the store took and holds."""
    a, b, a2 = (RayBlockStore(store_scope(app, model), 1 << 20, 5.0)
                for app, model in (("app-a", "m1"), ("app-b", "m1"), ("app-a", "m2")))  # fmt: skip
    key, data = b"k" * KEY_BYTES, np.arange(100, dtype=np.uint8)
    assert a.put([(key, data)]) == StoreState(100, 1, 100)
    assert a.put([(key, data)]) == StoreState(0, 1, 100)  # held already: nothing taken
    for other in (b, a2):
        other.refresh_index()
        assert not other.holds(key) and other.fetch([key]) == []
    a.refresh_index()
    assert a.holds(key) and len(a.fetch([key])) == 1
    assert len(_stores_of("app-a")) == 2 and len(_stores_of("app-b")) == 1
    assert main(["kv", "drop", "--app", "app-a"]) == 0
    assert sorted(json.loads(capsys.readouterr().out)["dropped"]) == sorted([a._local_name(), a2._local_name()])
    assert _stores_of("app-a") == [] and len(_stores_of("app-b")) == 1
    for client in (a, b, a2):
        client.close()
    assert main(["kv", "drop", "--app", "app-b"]) == 0
    assert _stores_of("app-b") == []


def test_no_ray_lookup_holds_the_lock(ray_cluster: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A lookup of the stores that hangs (a slow GCS: it has no timeout) on one thread leaves the client's
    lock free: another thread's call that needs it answers at once."""
    client = RayBlockStore(store_scope("app-lock", "m"), 1 << 20, 5.0)
    entered, release = threading.Event(), threading.Event()
    real = ray.util.list_named_actors

    def slow(all_namespaces: bool = False) -> list[dict[str, str]]:
        entered.set()
        release.wait(30)
        return real(all_namespaces=all_namespaces)

    monkeypatch.setattr(ray.util, "list_named_actors", slow)
    client._refreshed = 0.0  # the next call looks the stores up again
    looking = threading.Thread(target=client.refresh_index)
    looking.start()
    try:
        assert entered.wait(30)
        answered = threading.Event()
        threading.Thread(target=lambda: (client.take_faults(), answered.set())).start()
        assert answered.wait(5.0)
    finally:
        release.set()
        looking.join(30)
    monkeypatch.undo()
    client.close()
    assert main(["kv", "drop", "--app", "app-lock"]) == 0


def test_an_adapter_of_the_same_name_and_other_weights_gets_no_block_from_the_store(
    ray_cluster: None, tmp_path: Path
) -> None:
    """Two engines of one app on the node, each with an adapter named ``a`` of other weights: the second gets
    no block of the first's ``a`` from the cluster store (before, blocks were keyed by the adapter's name and
    served), nor does its base model; the first's files under another name get every full page."""
    model = write_llama_with_tokenizer(tmp_path / "model", seed=7)  # weights whose blocks no other test stored
    one, two = (make_peft_adapter(model, tmp_path / name, targets=PROJECTION_SETS["all"], rank=8, alpha=16,
                                  seed=seed) for seed, name in enumerate(("one", "two")))  # fmt: skip
    engine = {**ENGINE, "enable_lora": True, "max_lora_rank": 8, "max_loras": 2}
    prompt = PROMPTS[3]
    full_pages = (len(prompt) - 1) // 16 * 16

    def run(llm: LLM, lora: str | None) -> tuple[list[int], int]:
        out = llm.generate([prompt], GREEDY, use_tqdm=False, lora=lora)[0]
        return out.outputs[0].token_ids, out.num_cached_tokens

    plain = LLM(model=str(model), **engine)
    plain.load_lora("one", str(one))
    plain.load_lora("two", str(two))
    want = {name: run(plain, None if name == "base" else name)[0] for name in ("one", "two", "base")}
    assert len({tuple(tokens) for tokens in want.values()}) == 3
    plain.shutdown()

    first = LLM(model=str(model), kv_offload=CLUSTER, **engine)
    first.load_lora("a", str(one))
    assert run(first, "a") == (want["one"], 0)
    assert first.engine.kv_tiers is not None
    first.engine.kv_tiers.wait_for_saves()
    first.shutdown()

    second = LLM(model=str(model), kv_offload=CLUSTER, **engine)
    second.load_lora("a", str(two))
    second.load_lora("c", str(one))
    assert run(second, "a") == (want["two"], 0)
    assert run(second, None) == (want["base"], 0)  # nor does the base get the adapter's blocks
    assert _tier(second.engine, "cluster")["hits"] == 0
    assert run(second, "c") == (want["one"], full_pages)  # the first's "a", under another name
    assert _tier(second.engine, "cluster")["hits"] == full_pages // 16
    _assert_all_free(second.engine)
    second.shutdown()
