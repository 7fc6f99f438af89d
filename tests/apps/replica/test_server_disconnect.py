"""Clients that hang up: their requests are aborted in the scheduler and their KV pages freed (also with ``pd``)."""

from __future__ import annotations

import asyncio
import json
import random
import socket
from pathlib import Path

import aiohttp
import httpx2
import pytest

from tests.apps.pd_harness import PDServer, shared_pd
from tests.serve_harness import TIMEOUT, LiveServer, http, poll_until

pytestmark = pytest.mark.ray  # on the session's shared cluster: run with the other Ray modules, last (tests/conftest.py)

LONG = {"model": "tiny", "prompt": "a long story", "max_tokens": 2000, "ignore_eos": True}


def test_streaming_disconnect_frees_pages(live: LiveServer) -> None:
    steps_before = live.stats().num_steps
    with httpx2.Client(timeout=TIMEOUT) as web, \
            web.stream("POST", f"{live.url}/v1/completions", json={**LONG, "stream": True}) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                break  # one token arrived: the request is running; now hang up
    live.assert_pages_free(10.0)
    # Aborted, not finished: 2,000 tokens would have taken 2,000 decode steps.
    steps = live.stats().num_steps - steps_before
    assert steps < 1000, f"{steps} steps ran: the request was not aborted on disconnect"
    ok, body = http(f"{live.url}/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert ok == 200, body


def _send_raw(live: LiveServer, body: dict[str, object]) -> socket.socket:
    data = json.dumps(body).encode()
    host, port = live.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=TIMEOUT)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    return sock


def test_non_streaming_disconnect_frees_pages(live: LiveServer) -> None:
    steps_before = live.stats().num_steps
    with _send_raw(live, LONG):
        poll_until(lambda: live.stats().num_running > 0, TIMEOUT, "the request to start")
    live.assert_pages_free(10.0)
    steps = live.stats().num_steps - steps_before
    assert steps < 1000, f"{steps} steps ran: the request was not aborted on disconnect"


def test_streaming_client_gone_before_first_byte_is_aborted(live: LiveServer) -> None:
    steps_before = live.stats().num_steps
    with _send_raw(live, {**LONG, "stream": True}):
        poll_until(lambda: live.stats().num_unfinished_requests > 0, TIMEOUT, "the request to arrive")
    live.assert_pages_free(10.0)
    assert live.stats().num_steps - steps_before < 1000


async def _one(session: aiohttp.ClientSession, url: str, rng: random.Random) -> None:
    """Stream a long request and hang up after a random number of events (0: before any)."""
    cut = rng.choice([0, 0, 1, 2, 5, 10, 30])
    body = {**LONG, "stream": True, "prompt": f"story {rng.random()}"}
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        assert resp.status == 200
        seen = 0
        async for line in resp.content:
            if seen >= cut:
                break
            if line.startswith(b"data: {"):
                seen += 1
    # Leaving the block without reading to the end closes the connection.


def test_disconnect_storm_frees_every_page(live: LiveServer) -> None:
    """100 streams cancelled at random points (some by the client task being cancelled)."""
    rng = random.Random(0)

    async def storm() -> None:
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        async with aiohttp.ClientSession(connector=connector,
                                         timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as session:
            # A bystander that stays: one client's disconnect must not fail anyone else's request.
            bystander = asyncio.create_task(session.post(
                f"{live.url}/v1/completions", json={"prompt": "stay", "max_tokens": 200, "ignore_eos": True}))
            tasks = [asyncio.create_task(_one(session, live.url, rng)) for _ in range(100)]
            # A fifth are cancelled from outside, wherever they are (connecting, reading).
            done, pending = await asyncio.wait(tasks, timeout=0.5)
            for task in list(pending)[:20]:
                task.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            errors = [r for r in results if isinstance(r, BaseException)
                      and not isinstance(r, asyncio.CancelledError)]
            assert not errors, errors[:3]
            async with await bystander as resp:
                body = await resp.json()
                assert resp.status == 200, body
                assert body["usage"]["completion_tokens"] == 200

    asyncio.run(storm())
    live.assert_pages_free(10.0)
    ok, body = http(f"{live.url}/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert ok == 200, body


@pytest.fixture(scope="module")
def pd(live: LiveServer, tiny_model_dir: Path) -> PDServer:
    # The session's shared pd app (``shared_pd``): it prefills in chunks of 32 tokens, so each long prompt
    # takes many prefill steps and the storm's hang-ups land all along its submit (the remote prefill, then
    # the decode replica's take-over).
    return shared_pd(live, tiny_model_dir)


def test_pd_disconnect_storm_mid_submit_frees_every_page(pd: PDServer) -> None:
    """Long prompts, each prefilled remotely, whose clients hang up one after another while they are submitted."""
    num = 48
    steps_before, prefill_steps_before = pd.decode.stats().num_steps, pd.prefill.stats().num_steps
    rng = random.Random(1)

    async def one(session: aiohttp.ClientSession, i: int) -> None:
        prompt = f"storm {i} {rng.random()}: " + "a tale of ships and harbours, " * 8  # unique: never cached
        body = {"prompt": prompt, "max_tokens": 1500, "ignore_eos": True, "stream": i % 2 == 0}
        async with session.post(f"{pd.decode.url}/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.read()
            await resp.read()

    async def storm() -> None:
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        async with aiohttp.ClientSession(connector=connector,
                                         timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as session:
            tasks = [asyncio.create_task(one(session, i)) for i in range(num)]
            # Once the prefill pool computes the first prompts, hang up one client per prefill step or so,
            # in an order unrelated to arrival: hang-ups land before, during and after each submit.
            await asyncio.to_thread(poll_until, lambda: pd.prefill.stats().num_steps > prefill_steps_before,
                                    TIMEOUT, "the prefill pool to compute the first prompts")
            for task in rng.sample(tasks, len(tasks)):
                task.cancel()
                await asyncio.sleep(rng.uniform(0.0, 0.02))  # spreads the hang-ups over the submits
            results = await asyncio.gather(*tasks, return_exceptions=True)
            errors = [r for r in results if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError)]
            assert not errors, errors[:3]

    asyncio.run(storm())
    pd.assert_pages_free(10.0)
    # Aborted, not finished: any one of them left running would take 1,500 decode steps.
    steps = pd.decode.stats().num_steps - steps_before
    assert steps < 1000, f"{steps} decode steps ran: a request was left running after its client left"
    ok, body = http(f"{pd.decode.url}/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert ok == 200, body
