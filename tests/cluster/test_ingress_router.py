"""``cluster.ingress_router``: what the router reads from a request HAProxy forwards, and the load its picks
carry until the replicas report again. Live, through ``flotilla serve``: tests/cli/test_serve_haproxy.py."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from ray.serve._private.common import DeploymentHandleSource, DeploymentID
from ray.serve._private.request_router.common import PendingRequest

from cluster.ingress_router import routed_request
from cluster.pending_requests import RoutingKey, request_key, request_model, request_owner
from cluster.request_router import ROUTING_NUM_OPEN, ROUTING_REPORTED_AT, PrefixAwareRequestRouter
from cluster.response_ids import response_id
from tests.cluster.test_request_router import _replica

DOC = "You are a ship's navigator. " * 8


def test_the_body_s_prompt_and_model_route_the_request() -> None:
    arg = routed_request(json.dumps({"model": "task-a", "prompt": DOC + "where to?"}).encode(), None)
    assert request_key(arg) == RoutingKey("prompt", DOC + "where to?")
    assert request_model(arg) == "task-a"
    chat = routed_request(json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode(), None)
    assert request_key(chat) == RoutingKey("prompt", "user:hi")


def test_the_session_header_wins_over_the_prompt() -> None:
    key = request_key(routed_request(json.dumps({"prompt": DOC}).encode(), "conversation-7"))
    assert key is not None and key.kind == "session" and key.text != "conversation-7"  # hashed, whole-match only


def test_a_body_cut_short_or_not_json_routes_on_load_alone() -> None:
    whole = json.dumps({"prompt": DOC}).encode()
    for body in (whole[: len(whole) // 2], b"not json", b"", b"[1, 2]"):
        arg = routed_request(body, None)
        assert request_key(arg) is None and request_model(arg) is None and request_owner(arg) is None


def test_a_responses_request_goes_to_the_replica_holding_its_previous_response() -> None:
    rid = response_id("b")
    assert request_owner(routed_request(json.dumps({"input": "more", "previous_response_id": rid}).encode(),
                                        None)) == "b"
    assert request_owner(routed_request(json.dumps({"input": "first"}).encode(), None)) is None


def test_picks_without_dispatch_count_as_load_until_the_next_report() -> None:
    """The ingress router picks without sending (HAProxy sends): Serve reports no request sent, so the router
    counts its own picks on top of each replica's last report, and a burst spreads instead of following
    one stale figure."""

    async def scenario() -> None:
        dep = DeploymentID(name="LLMServer", app_name="flotilla")
        router = PrefixAwareRequestRouter(dep, DeploymentHandleSource.UNKNOWN)
        router.initialize_state(imbalance_threshold=2, seed=0)
        replicas = [_replica(n, dep, {ROUTING_NUM_OPEN: 0, ROUTING_REPORTED_AT: 1.0}) for n in "ab"]
        meta = SimpleNamespace(internal_request_id="r", multiplexed_model_id="")
        picked = []
        for i in range(6):  # unique prompts: no affinity, the lighter of the two each time
            arg = routed_request(json.dumps({"prompt": f"question {i}"}).encode(), None)
            ranks = await router.choose_replicas(replicas, PendingRequest(args=[arg], kwargs={}, metadata=meta))
            picked.append(ranks[0][0].replica_id.unique_id)
        assert sorted(picked) == ["a"] * 3 + ["b"] * 3, picked
        assert [router.replica_load(r) for r in replicas] == [3.0, 3.0]
        # A document's requests stick to one replica while it stays within the imbalance bound.
        doc = [routed_request(json.dumps({"prompt": DOC + f"q{i}"}).encode(), None) for i in range(3)]
        homes = {(await router.choose_replicas(replicas, PendingRequest(args=[a], kwargs={}, metadata=meta)))[0][0]
                 .replica_id.unique_id for a in doc}  # fmt: skip
        assert len(homes) == 1, homes
        # The next report states what is open (here: everything finished); earlier picks stop counting.
        replicas[0].routing_stats = {ROUTING_NUM_OPEN: 1, ROUTING_REPORTED_AT: 2.0}
        assert router.replica_load(replicas[0]) == 1.0
        router.update_replicas([replicas[1]])  # a leaves the fleet: its count goes with it
        assert "a" not in router._unreported

    asyncio.run(scenario())
