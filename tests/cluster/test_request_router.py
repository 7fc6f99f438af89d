"""The Serve request router without a cluster: routing keys, ranks, load accounting, config."""

from __future__ import annotations

import asyncio
import pickle
from types import SimpleNamespace
from typing import Any

import pytest

from cluster.pending_requests import (
    RoutingKey,
    key_from_headers,
    requested_model,
    response_owner,
    routing_key,
)
from cluster.request_router import (
    ROUTER_CLASS,
    PrefixAwareRequestRouter,
    PrefixRouting,
    replica_key,
    router_config,
)
from cluster.response_ids import response_id
from scheduling.errors import InvalidParameterError

DOC = "You are a ship's navigator. " * 8  # > 64 chars: long enough to count as affinity


class Scope:
    """Stands in for Serve's StreamingHTTPRequest: only ``asgi_scope`` is read."""

    def __init__(self, headers: list[tuple[bytes, bytes]], path: str = "/v1/completions") -> None:
        self.asgi_scope = {"type": "http", "path": path, "headers": headers}


def test_routing_key_from_http_headers_pickled_like_the_proxy_sends_them() -> None:
    prefix = pickle.dumps(Scope([(b"x-flotilla-prefix", DOC.encode()), (b"x-flotilla-session", b"s1")]))
    assert routing_key([prefix], {}) == RoutingKey("prompt", DOC)
    session = pickle.dumps(Scope([(b"X-Flotilla-Session", b"s1")]))
    key = routing_key([session], {})
    assert key is not None and key.kind == "session" and len(key.text) == 64
    assert routing_key([pickle.dumps(Scope([]))], {}) is None
    assert routing_key([b"not a pickle"], {}) is None
    assert key_from_headers([(b"x-flotilla-session", b"s1")]) == key


def test_routing_key_from_handle_arguments() -> None:
    assert routing_key([{"prompt": "hello"}], {}) == RoutingKey("prompt", "hello")
    assert routing_key([{"prompt": ["first", "second"]}], {}) == RoutingKey("prompt", "first")
    chat = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}
    assert routing_key([chat], {}) == RoutingKey("prompt", "system:be brief\nuser:hi")
    assert routing_key(["raw text"], {}) == RoutingKey("prompt", "raw text")
    assert routing_key([], {}) is None
    assert routing_key([{"prompt": [1, 2, 3]}], {}) is None  # token ids: nothing to match as text


def test_ranks_prefer_affinity_then_shortest_queue() -> None:
    routing = PrefixRouting(seed=0)
    loads = {"a": 0.0, "b": 1.0, "c": 2.0}
    key = RoutingKey("prompt", DOC + "question 1")
    first = routing.rank(key, loads, 0.0)[0][0]
    routing.record(key, first, 0.0)
    for i in range(2, 6):
        ranks = routing.rank(RoutingKey("prompt", DOC + f"question {i}"), loads, float(i))
        assert ranks[0] == [first]
        assert ranks[1] == sorted((r for r in loads if r != first), key=loads.__getitem__)
    assert routing.rank(key, {}, 0.0) == []
    assert routing.rank(None, {"only": 0.0}, 0.0) == [["only"]]


def test_sessions_match_whole_ids_only() -> None:
    routing = PrefixRouting(seed=1)
    even = {"a": 0.0, "b": 0.0, "c": 0.0, "d": 0.0}
    keys = [key_from_headers([(b"x-flotilla-session", f"user-{i}".encode())]) for i in range(12)]
    homes = {}
    for i, key in enumerate(keys):
        homes[i] = routing.rank(key, even, 0.0)[0][0]
        routing.record(key, homes[i], 0.0)
    for i, key in enumerate(keys):
        assert routing.rank(key, even, 1.0)[0][0] == homes[i]
    assert len(set(homes.values())) > 1  # sessions spread, they do not all share a hex prefix


def test_overloaded_affinity_replica_loses_the_request() -> None:
    routing = PrefixRouting(imbalance_threshold=2, seed=0)
    key = RoutingKey("prompt", DOC)
    routing.record(key, "a", 0.0)
    assert routing.rank(key, {"a": 2.0, "b": 0.0}, 1.0)[0] == ["a"]
    assert routing.rank(key, {"a": 3.0, "b": 0.0}, 1.0)[0] == ["b"]


def test_forgetting_a_replica_that_left() -> None:
    routing = PrefixRouting(seed=0)
    key = RoutingKey("prompt", DOC)
    routing.record(key, "a", 0.0)
    routing.forget_missing({"b", "c"})
    assert routing.prompts.num_chars("a") == 0
    # It is not tombstoned: if it comes back, it is a candidate again.
    assert routing.rank(key, {"a": 0.0}, 1.0) == [["a"]]


@pytest.mark.parametrize(
    ("option", "expected"),
    [(None, {"request_router_class": ROUTER_CLASS, "request_router_kwargs": {},
             "request_routing_stats_period_s": 2.0}), ("default", None), ({"kind": "default"}, None),
     ("prefix", {"request_router_class": ROUTER_CLASS, "request_router_kwargs": {},
                 "request_routing_stats_period_s": 2.0}),
     ({"imbalance_threshold": 4, "stats_period_s": 1},
      {"request_router_class": ROUTER_CLASS, "request_router_kwargs": {"imbalance_threshold": 4},
       "request_routing_stats_period_s": 1.0})],
)
def test_router_config(option: Any, expected: dict[str, Any] | None) -> None:
    assert router_config(option) == expected


@pytest.mark.parametrize("option", ["round-robin", {"ttl_s": 0}, {"no_such_option": 1}])
def test_router_config_rejects_bad_options(option: Any) -> None:
    with pytest.raises(InvalidParameterError) as info:
        router_config(option)
    assert info.value.param == "request_router"


def _replica(name: str, deployment: Any, stats: dict[str, Any] | None = None) -> Any:
    from ray.serve.request_router import ReplicaID

    return SimpleNamespace(replica_id=ReplicaID(unique_id=name, deployment_id=deployment),
                           routing_stats=stats or {}, max_ongoing_requests=256)


def test_serve_router_ranks_counts_and_forgets() -> None:
    """The RequestRouter subclass itself, driven as Serve's router would (no cluster)."""
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID
    from ray.serve._private.request_router.common import PendingRequest

    async def scenario() -> None:
        dep = DeploymentID(name="LLMServer", app_name="flotilla")
        router = PrefixAwareRequestRouter(dep, DeploymentHandleSource.UNKNOWN)
        router.initialize_state(imbalance_threshold=1, seed=0)
        replicas = [_replica(n, dep, {"num_open": i}) for i, n in enumerate("abc")]
        assert router.replica_load(replicas[2]) == 2.0  # never used: its routing stats

        def pending() -> Any:
            headers = [(b"x-flotilla-prefix", DOC.encode())]
            meta = SimpleNamespace(internal_request_id="r", multiplexed_model_id="")
            return PendingRequest(args=[pickle.dumps(Scope(headers))], kwargs={}, metadata=meta)

        req = pending()
        ranks = await router.choose_replicas(replicas, req)
        first = ranks[0][0]
        assert req.routing_context.should_backoff
        assert {r.replica_id.unique_id for r in ranks[1]} | {first.replica_id.unique_id} == set("abc")
        router.on_send_request(first.replica_id)
        assert (await router.choose_replicas(replicas, pending()))[0][0] is first  # affinity (load 1)
        router.on_send_request(first.replica_id)
        router.on_send_request(first.replica_id)  # load 3 vs 0 on another: beyond the threshold
        assert (await router.choose_replicas(replicas, pending()))[0][0] is not first
        for _ in range(3):
            router.on_request_completed(first.replica_id, "r")
        assert router.replica_load(first) == 0.0
        router.update_replicas([r for r in replicas if r is not first])
        assert router._state().prompts.num_chars(replica_key(first.replica_id)) == 0

    asyncio.run(scenario())


def test_requested_model_from_the_sdk_header_or_a_handle_body() -> None:
    assert requested_model([pickle.dumps(Scope([(b"X-Flotilla-Model", b"task-a")]))], {}) == "task-a"
    assert requested_model([pickle.dumps(Scope([(b"x-flotilla-prefix", b"p")]))], {}) is None
    assert requested_model([{"model": "task-b", "prompt": "x"}], {}) == "task-b"
    assert requested_model([{"prompt": "x"}], {}) is None and requested_model([], {}) is None


def test_adapter_requests_go_where_the_adapter_is_loaded_within_the_imbalance_bound() -> None:
    routing = PrefixRouting(imbalance_threshold=2, seed=0)
    loads = {"a": 0.0, "b": 1.0, "c": 2.0}
    assert routing.rank(None, loads, 0.0, frozenset({"c", "b"}))[0] == ["b"]  # the least loaded holder
    assert routing.rank(None, loads, 0.0, frozenset({"c"}))[0] == ["c"]  # 2 over the least: within the bound
    assert routing.rank(None, {**loads, "c": 3.0}, 0.0, frozenset({"c"}))[0] == ["a"]  # beyond: least loaded
    assert routing.rank(None, loads, 0.0, frozenset())[0] == ["a"]  # nowhere yet: least loaded loads it
    # The adapter outranks prompt affinity (its prefix cache is per adapter anyway).
    key = RoutingKey("prompt", DOC)
    routing.record(key, "a", 0.0)
    assert routing.rank(key, loads, 0.0, frozenset({"b"}))[0] == ["b"]


def test_an_adapter_follows_where_this_router_sent_it_before_any_replica_reports_it() -> None:
    routing = PrefixRouting(imbalance_threshold=2, ttl_s=60, seed=0)
    assert routing.adapter_holders("x", frozenset(), 0.0) == frozenset()
    first = routing.rank(None, {"a": 0.0, "b": 1.0}, 0.0, routing.adapter_holders("x", frozenset(), 0.0))[0][0]
    assert first == "a"
    routing.record_adapter("x", first, 0.0)
    # b is now the least loaded, but a is loading x (within the imbalance bound): x follows it.
    held = routing.adapter_holders("x", frozenset(), 1.0)
    assert held == {"a"} and routing.rank(None, {"a": 2.0, "b": 0.0}, 1.0, held)[0] == ["a"]
    assert routing.adapter_holders("x", frozenset({"b"}), 1.0) == {"a", "b"}  # and what replicas report
    assert routing.adapter_holders("x", frozenset(), 61.0) == frozenset()  # forgotten after the TTL
    routing.forget_missing({"b"})
    assert routing.adapter_holders("x", frozenset(), 1.0) == frozenset()  # a left the fleet


def test_serve_router_uses_the_replicas_reported_adapters() -> None:
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID
    from ray.serve._private.request_router.common import PendingRequest

    async def scenario() -> None:
        dep = DeploymentID(name="LLMServer", app_name="flotilla")
        router = PrefixAwareRequestRouter(dep, DeploymentHandleSource.UNKNOWN)
        router.initialize_state(imbalance_threshold=8, seed=0)
        stats = [{"num_open": 0, "loras": [], "served_model": "base"},
                 {"num_open": 3, "loras": ["task"], "served_model": "base"}]  # fmt: skip
        replicas = [_replica(n, dep, s) for n, s in zip("ab", stats, strict=True)]

        def pending(model: str) -> Any:
            meta = SimpleNamespace(internal_request_id="r", multiplexed_model_id="")
            return PendingRequest(args=[pickle.dumps(Scope([(b"x-flotilla-model", model.encode())]))],
                                  kwargs={}, metadata=meta)  # fmt: skip

        assert (await router.choose_replicas(replicas, pending("task")))[0][0] is replicas[1]
        assert (await router.choose_replicas(replicas, pending("base")))[0][0] is replicas[0]  # p2c: least loaded
        assert (await router.choose_replicas(replicas, pending("other")))[0][0] is replicas[0]

    asyncio.run(scenario())


def test_an_app_serving_adapters_tells_the_router_its_base_model() -> None:
    """Built with the base model's name, the router knows adapter requests before any replica reports."""
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID
    from ray.serve._private.request_router.common import PendingRequest

    config = router_config("prefix", lora_base_model="base")
    assert config is not None and config["request_router_kwargs"] == {"lora_base_model": "base"}
    assert router_config("default", lora_base_model="base") is None

    async def scenario() -> None:
        dep = DeploymentID(name="LLMServer", app_name="flotilla")
        router = PrefixAwareRequestRouter(dep, DeploymentHandleSource.UNKNOWN)
        router.initialize_state(**config["request_router_kwargs"], imbalance_threshold=8, seed=0)
        replicas = [_replica(n, dep) for n in "ab"]  # fresh: no routing stats reported yet

        def pending(model: str) -> Any:
            meta = SimpleNamespace(internal_request_id="r", multiplexed_model_id="")
            return PendingRequest(args=[pickle.dumps(Scope([(b"x-flotilla-model", model.encode())]))],
                                  kwargs={}, metadata=meta)  # fmt: skip

        first = (await router.choose_replicas(replicas, pending("task")))[0][0]
        for _ in range(2):  # the first replica is now the busier one
            router.on_send_request(first.replica_id)
        assert (await router.choose_replicas(replicas, pending("task")))[0][0] is first  # it is loading task
        other = next(r for r in replicas if r is not first)
        assert (await router.choose_replicas(replicas, pending("other-task")))[0][0] is other  # least loaded

    asyncio.run(scenario())


def test_requests_about_a_stored_response_go_to_the_replica_that_holds_it() -> None:
    """GET/DELETE /v1/responses/<id> by path, a continuation by X-Flotilla-Previous-Response, even when loaded;
    the header on any other request pins nothing (it would route past the load bound)."""
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID
    from ray.serve._private.request_router.common import PendingRequest

    rid = response_id("b")
    by_path = SimpleNamespace(asgi_scope={"type": "http", "path": f"/v1/responses/{rid}", "headers": []})
    assert response_owner([pickle.dumps(by_path)], {}) == "b"
    by_path.asgi_scope["path"] = f"/app/v1/responses/{rid}"  # under an app's route prefix
    assert response_owner([pickle.dumps(by_path)], {}) == "b"
    header = [(b"X-Flotilla-Previous-Response", rid.encode())]
    assert response_owner([pickle.dumps(Scope(header, "/v1/responses"))], {}) == "b"
    assert response_owner([pickle.dumps(Scope(header, "/app/v1/responses"))], {}) == "b"
    for other in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings"):  # the header pins Responses only
        assert response_owner([pickle.dumps(Scope(header, other))], {}) is None, other
    plain = [(b"x-flotilla-previous-response", b"resp_plain")]
    assert response_owner([pickle.dumps(Scope(plain, "/v1/responses"))], {}) is None
    assert response_owner([pickle.dumps(Scope([]))], {}) is None and response_owner([{"prompt": "x"}], {}) is None

    async def scenario() -> None:
        dep = DeploymentID(name="LLMServer", app_name="flotilla")
        router = PrefixAwareRequestRouter(dep, DeploymentHandleSource.UNKNOWN)
        router.initialize_state(imbalance_threshold=1, seed=0)
        replicas = [_replica(n, dep, {"num_open": load}) for n, load in (("a", 0), ("b", 50), ("c", 3))]
        meta = SimpleNamespace(internal_request_id="r", multiplexed_model_id="")
        headers = [(b"x-flotilla-previous-response", rid.encode())]
        continuation = PendingRequest(args=[pickle.dumps(Scope(headers, "/v1/responses"))], kwargs={}, metadata=meta)
        ranks = await router.choose_replicas(replicas, continuation)
        assert [[r.replica_id.unique_id for r in rank] for rank in ranks] == [["b"], ["a", "c"]]
        chat = PendingRequest(args=[pickle.dumps(Scope(headers, "/v1/chat/completions"))], kwargs={}, metadata=meta)
        assert (await router.choose_replicas(replicas, chat))[0][0].replica_id.unique_id != "b"  # not pinned
        gone = await router.choose_replicas([replicas[0], replicas[2]], continuation)
        assert gone[0][0].replica_id.unique_id == "a"  # its replica left: anywhere (it answers 404)

    asyncio.run(scenario())
