"""API keys (401 in the OpenAI envelope), the key that owns a stored response, and backpressure (429 +
Retry-After) on a guarded app.

The app runs beside the package's default one on the same Ray cluster and
Serve instance, under the route prefix ``/guarded``, with two keys, a batch
of 2 and a queue of 2: a replica holds at most 4 requests.
"""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import ray
from ray import serve

import flotilla
from apps.builder import build_app
from tests.serve_harness import ACTOR_NAMESPACE, ENGINE, TIMEOUT, LiveServer, http, wait_healthy

pytestmark = pytest.mark.ray  # on the session's shared cluster: run with the other Ray modules, last (tests/conftest.py)

KEYS = ["key-one", "key-two"]
GOOD = {"Authorization": "Bearer key-two"}
OTHER = {"Authorization": "Bearer key-one"}
CAPACITY = 4  # max_num_seqs + max_queued_requests of the guarded app
UNAUTHORIZED = {"error": {"message": "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                          "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}
AT_CAPACITY = {"error": {"message": f"this replica is at capacity ({CAPACITY} requests in flight); retry after 1 s",
                         "type": "invalid_request_error", "param": None, "code": "rate_limit_exceeded"}}


@pytest.fixture(scope="module")
def guarded(live: LiveServer, tiny_model_dir: Path) -> Iterator[LiveServer]:
    args = {**ENGINE, "model": str(tiny_model_dir), "served_model_name": "tiny", "max_num_seqs": 2,
            "api_keys": KEYS, "max_queued_requests": 2,
            "scheduler_options": {"name": "guarded-scheduler", "namespace": ACTOR_NAMESPACE}}
    serve.run(build_app(args), name="guarded", route_prefix="/guarded")
    try:
        url = f"{live.url}/guarded"
        wait_healthy(url)  # /health needs no key
        yield LiveServer(url, "guarded-scheduler")
    finally:
        serve.delete("guarded")


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "key-two"},
                                     {"Authorization": "Basic key-two"}, {"Authorization": "Bearer "}])
def test_requests_without_a_valid_key_get_401(guarded: LiveServer, headers: dict[str, str]) -> None:
    for path, body in [("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/tokenize", {"prompt": "hi"}), ("/v1/models", None)]:
        status, err = http(f"{guarded.url}{path}", body, headers)
        assert status == 401, (path, err)
        assert err["error"]["code"] == "invalid_api_key" and err["error"]["type"] == "invalid_request_error"


def test_responses_embeddings_and_detokenize_without_a_valid_key_get_401(guarded: LiveServer) -> None:
    """Every endpoint behind the key, a stored response's included: nothing is read, deleted or run."""
    status, made = http(f"{guarded.url}/v1/responses", {"input": "hi", "max_output_tokens": 1}, GOOD)
    assert status == 200, made
    steps = guarded.stats().num_steps
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "key-two"}):
        for method, path, body in [
                ("POST", "/v1/responses", {"input": "hi", "max_output_tokens": 1}),
                ("POST", "/v1/responses", {"input": "hi", "previous_response_id": made["id"]}),
                ("GET", f"/v1/responses/{made['id']}", None), ("DELETE", f"/v1/responses/{made['id']}", None),
                ("POST", "/v1/embeddings", {"input": "hi"}), ("POST", "/detokenize", {"tokens": [1, 2]})]:
            assert http(f"{guarded.url}{path}", body, headers, method) == (401, UNAUTHORIZED), (method, path)
    assert guarded.stats().num_steps == steps  # no request reached the engine
    status, kept = http(f"{guarded.url}/v1/responses/{made['id']}", headers=GOOD)
    assert status == 200 and kept["id"] == made["id"], kept


def test_a_stored_response_belongs_to_the_key_that_made_it(guarded: LiveServer) -> None:
    """Another key gets the 404 of an unknown id on GET, DELETE and previous_response_id; the owner still has it."""
    status, made = http(f"{guarded.url}/v1/responses", {"input": "mine", "max_output_tokens": 2}, GOOD)
    assert status == 200, made
    rid = made["id"]
    not_found = {"error": {"message": f"no response with id '{rid}' is stored on this replica for this API key (it "
                                      "was never made, was made with store=false or another key, was deleted, or "
                                      "was evicted from the bounded store)",
                           "type": "invalid_request_error", "param": None, "code": "response_not_found"}}
    assert http(f"{guarded.url}/v1/responses/{rid}", headers=OTHER) == (404, not_found)
    assert http(f"{guarded.url}/v1/responses/{rid}", headers=OTHER, method="DELETE") == (404, not_found)
    continued = {"error": {**not_found["error"], "param": "previous_response_id"}}
    assert http(f"{guarded.url}/v1/responses", {"input": "go on", "previous_response_id": rid, "max_output_tokens": 1},
                OTHER) == (404, continued)
    status, again = http(f"{guarded.url}/v1/responses/{rid}", headers=GOOD)
    assert status == 200 and again == made, again
    status, chained = http(f"{guarded.url}/v1/responses", {"input": "go on", "previous_response_id": rid,
                                                            "max_output_tokens": 1}, GOOD)
    assert status == 200 and chained["previous_response_id"] == rid, chained
    assert http(f"{guarded.url}/v1/responses/{rid}", headers=GOOD, method="DELETE") == (
        200, {"id": rid, "object": "response.deleted", "deleted": True})
    guarded.assert_pages_free()


def test_responses_and_embeddings_get_429_when_admission_is_full(guarded: LiveServer) -> None:
    """Four long streams hold every slot; the new endpoints are refused with 429 + Retry-After, then served."""
    hold = {"max_tokens": 2000, "ignore_eos": True, "stream": True}  # far longer than this test

    async def full() -> list[tuple[str, int, dict[str, Any], str | None]]:
        async with aiohttp.ClientSession(headers=GOOD, timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as s:
            # Each answer's headers come once its stream is open: then it holds its slot.
            holders = [await s.post(f"{guarded.url}/v1/completions", json={**hold, "prompt": f"hold {i}"})
                       for i in range(CAPACITY)]
            try:
                assert [h.status for h in holders] == [200] * CAPACITY
                refused = []
                for path, body in [("/v1/responses", {"input": "hi", "max_output_tokens": 1}),
                                   ("/v1/responses", {"input": "hi", "max_output_tokens": 1, "stream": True}),
                                   ("/v1/embeddings", {"input": ["a", "b"]})]:
                    async with s.post(f"{guarded.url}{path}", json=body) as resp:
                        refused.append((path, resp.status, await resp.json(), resp.headers.get("Retry-After")))
                return refused
            finally:
                for holder in holders:
                    holder.close()  # hang up: their requests are aborted

    for path, status, body, retry_after in asyncio.run(full()):
        assert (status, body, retry_after) == (429, AT_CAPACITY, "1"), path
    guarded.assert_pages_free()
    status, body = http(f"{guarded.url}/v1/responses", {"input": "hi", "max_output_tokens": 1}, GOOD)
    assert status == 200 and body["status"] in ("completed", "incomplete"), body
    status, body = http(f"{guarded.url}/v1/embeddings", {"input": ["a", "b"]}, GOOD)
    assert status == 200 and len(body["data"]) == 2, body


def test_valid_keys_are_let_in_by_every_client(guarded: LiveServer) -> None:
    status, body = http(f"{guarded.url}/v1/completions", {"prompt": "hi", "max_tokens": 2}, GOOD)
    assert status == 200 and body["usage"]["completion_tokens"] == 2
    oai = openai.OpenAI(base_url=f"{guarded.url}/v1", api_key=KEYS[0], max_retries=0, timeout=TIMEOUT)
    assert oai.completions.create(model="tiny", prompt="hi", max_tokens=2).usage.completion_tokens == 2  # type: ignore[union-attr]
    with flotilla.Client(guarded.url, api_key=KEYS[1]) as sdk:
        assert sdk.complete("hi", max_tokens=2).usage.completion_tokens == 2
    with flotilla.Client(guarded.url, api_key="nope", max_retries=0) as sdk, \
            pytest.raises(flotilla.AuthenticationError):
        sdk.complete("hi", max_tokens=2)
    # The probes need no key: Serve's health check and a Prometheus scrape carry none.
    assert http(f"{guarded.url}/health")[0] == 200
    with urllib.request.urlopen(f"{guarded.url}/metrics", timeout=TIMEOUT) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
        metrics = resp.read().decode()
    assert "flotilla:num_requests_running" in metrics and "flotilla:kv_cache_usage_perc" in metrics, metrics[:500]


def test_a_burst_of_ten_times_capacity_gets_429_with_retry_after(guarded: LiveServer) -> None:
    capacity = 4
    # Long enough that the burst has all arrived before the first admitted requests finish,
    # however fast a step is: 512 engine steps each (64 let a fast tiny step drain the replica
    # as quickly as the proxy fed it, and nothing was refused).
    max_tokens = 512

    async def burst() -> list[tuple[int, dict[str, Any], str | None]]:
        body = {"prompt": "burst", "max_tokens": max_tokens, "ignore_eos": True}
        async with aiohttp.ClientSession(headers=GOOD, timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as s:
            async def one() -> tuple[int, dict[str, Any], str | None]:
                async with s.post(f"{guarded.url}/v1/completions", json=body) as resp:
                    return resp.status, await resp.json(), resp.headers.get("Retry-After")
            return await asyncio.gather(*(one() for _ in range(10 * capacity)))

    results = asyncio.run(burst())
    refused = [r for r in results if r[0] == 429]
    served = [r for r in results if r[0] == 200]
    assert len(refused) + len(served) == len(results), [r[:2] for r in results if r[0] not in (200, 429)]
    assert len(served) >= capacity and refused, f"{len(served)} served, {len(refused)} refused"
    for _, err, retry_after in refused:
        assert err["error"]["code"] == "rate_limit_exceeded" and retry_after is not None and int(retry_after) >= 1
    assert all(body["usage"]["completion_tokens"] == max_tokens for _, body, _ in served)
    guarded.assert_pages_free()
    assert http(f"{guarded.url}/v1/completions", {"prompt": "hi", "max_tokens": 1}, GOOD)[0] == 200


def test_scheduler_actor_of_guarded_app_is_its_own(guarded: LiveServer, live: LiveServer) -> None:
    """The guarded app's requests run on its own scheduler actor, not on the package app's."""
    assert guarded.actor_name is not None and live.actor_name is not None
    mine, theirs = (ray.get_actor(name, namespace=ACTOR_NAMESPACE) for name in (guarded.actor_name, live.actor_name))
    assert mine._actor_id != theirs._actor_id
    steps = guarded.stats().num_steps, live.stats().num_steps
    status, body = http(f"{guarded.url}/v1/completions", {"prompt": "mine", "max_tokens": 4, "ignore_eos": True}, GOOD)
    assert status == 200, body
    assert guarded.stats().num_steps > steps[0] and live.stats().num_steps == steps[1]
