"""Elasticity on a real local Ray cluster: prefix affinity, drain on scale-down, autoscaling.

One app for the module (``APP``, beside the session's tiny app on the shared
cluster: ``tests.serve_harness.live_server``). Each test first reshapes the app
to the replicas it needs and waits for exactly them, so none depends on what an
earlier one left. Every ``serve.run`` from Python is a new code version to Serve
(it draws a random one), which replaces every replica, so ``reshape`` calls it
only when the app is not already in the shape asked for. Replicas are small (a
tenth of a CPU, two sequences each) so replica capacity, not the machine, runs
out.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ray import serve
from ray.serve.schema import ApplicationStatusOverview

from apps.builder import build_app
from flotilla.sse import DONE, SSEDecoder
from tests.serve_harness import ENGINE, LiveServer, http, live_server, poll_until

pytestmark = pytest.mark.ray  # on the session's shared cluster: run with the other Ray modules, last (tests/conftest.py)

SMALL: dict[str, Any] = {"max_num_seqs": 2, "scheduler_options": {"num_cpus": 0.1},
                         "replica_options": {"num_cpus": 0.1}, "graceful_shutdown_timeout_s": 60}
ROUTER = {"imbalance_threshold": 100}  # affinity always wins here: the assertion is exact
DEADLINE_S = 90.0
APP = "elastic"
DRAIN_TOKENS = 1900  # a stream's tokens in the drain test: its prompt and these fit max_model_len (2048)
DOCS = [f"[doc {g}] " + f"chapter {g} of the harbour log; " * 24 for g in range(2)]


def app_args(model_dir: Path, **extra: Any) -> dict[str, Any]:
    return {"model": str(model_dir), "served_model_name": "tiny", **ENGINE, **SMALL,
            "request_router": ROUTER, **extra}


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[LiveServer]:
    args = app_args(tiny_model_dir, num_replicas=3)
    with live_server(tiny_model_dir, APP, **args) as live:
        DEPLOYED[APP] = args
        wait_replicas(3)
        yield live
    DEPLOYED.clear()


# The arguments of the app's last deployment in this module (``live_server`` includes the named scheduler
# options beside them; they do not change). Read only to skip a serve.run that would change nothing.
DEPLOYED: dict[str, dict[str, Any]] = {}


def deploy(args: dict[str, Any]) -> None:
    """``serve.run`` of the app with ``args`` (every replica replaced: module docstring); recorded."""
    DEPLOYED.pop(APP, None)  # unknown until serve.run returns
    serve.run(build_app(args), name=APP, route_prefix=f"/{APP}")
    DEPLOYED[APP] = args


def reshape(model_dir: Path, num_replicas: int) -> None:
    """The app with exactly ``num_replicas`` running (and none starting or stopping) when this returns;
    redeployed only when its last deployment asked for another shape (or for autoscaling)."""
    args = app_args(model_dir, num_replicas=num_replicas)
    if DEPLOYED.get(APP) != args:
        deploy(args)
    wait_replicas(num_replicas)


def replica_states(app: ApplicationStatusOverview | None = None) -> dict[str, int]:
    """Replicas of the app by state (``RUNNING``, ``STARTING``, ``STOPPING``...), from ``app`` or a fresh status."""
    app = app or serve.status().applications[APP]
    out: dict[str, int] = {}
    for deployment in app.deployments.values():
        for state, n in deployment.replica_states.items():
            out[str(state).rsplit(".", 1)[-1]] = out.get(str(state).rsplit(".", 1)[-1], 0) + int(n)
    return out


def wait_replicas(n: int, deadline_s: float = DEADLINE_S) -> None:
    """Until exactly ``n`` replicas run and none is starting or stopping (one status call per loop)."""
    end = time.monotonic() + deadline_s
    while True:
        states = replica_states()
        if states.get("RUNNING", 0) == n and sum(states.values()) == n:
            return
        assert time.monotonic() < end, f"never reached {n} replicas: {states}"
        time.sleep(0.5)  # polling Serve's controller, which has no change notification


class Stream(threading.Thread):
    """One streaming completion; records finish reason, completion tokens (from the usage chunk) and
    errors; ``started`` is set on the first chunk with text."""

    def __init__(self, url: str, prompt: str, max_tokens: int, headers: dict[str, str] | None = None) -> None:
        super().__init__(daemon=True)
        self.url, self.prompt, self.max_tokens, self.headers = url, prompt, max_tokens, headers or {}
        self.started = threading.Event()
        self.num_tokens = 0
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.ended_at: float | None = None  # time.monotonic() when the stream ended

    def run(self) -> None:
        body = json.dumps({"model": "tiny", "prompt": self.prompt, "max_tokens": self.max_tokens,
                           "ignore_eos": True, "stream": True,
                           "stream_options": {"include_usage": True}}).encode()
        req = urllib.request.Request(f"{self.url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json", **self.headers})
        try:
            decoder = SSEDecoder()  # the SDK's parser: one SSE parser in the repo
            with urllib.request.urlopen(req, timeout=120) as resp:
                for raw in resp:
                    data = decoder.feed(raw)
                    if data is None or data == DONE:
                        continue
                    chunk = json.loads(data)
                    if "error" in chunk:
                        self.error = str(chunk["error"])
                    if chunk.get("usage"):
                        self.num_tokens = chunk["usage"]["completion_tokens"]
                    for choice in chunk.get("choices", []):
                        if choice.get("text"):
                            self.started.set()
                        self.finish_reason = choice.get("finish_reason") or self.finish_reason
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.ended_at = time.monotonic()
            self.started.set()


def completion(url: str, prompt: str, headers: dict[str, str] | None = None) -> dict[str, Any]:
    status, body = http(f"{url}/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 2},
                        headers)
    assert status == 200, body
    return body


def test_shared_prefix_requests_stick_to_one_replica(server: LiveServer, tiny_model_dir: Path) -> None:
    """With 3 replicas, every repeat of a document hits the prefix cache of the replica that has it."""
    reshape(tiny_model_dir, 3)  # with one replica every repeat would hit the cache, routed or not
    for doc in DOCS:
        first = completion(server.url, doc + "Q0", {"X-Flotilla-Prefix": doc})
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        for q in range(1, 5):
            usage = completion(server.url, doc + f"Q{q}", {"X-Flotilla-Prefix": doc})["usage"]
            # The whole shared document (page-aligned, so up to one page short) was cached.
            assert usage["prompt_tokens_details"]["cached_tokens"] >= len(doc) - 16, usage


def test_scale_down_drains_in_flight_streams(server: LiveServer, tiny_model_dir: Path) -> None:
    """Removing two of three replicas while six long streams run on them loses none."""
    reshape(tiny_model_dir, 3)
    # Long streams (tiny writes a few hundred tokens a second each), under routing keys that share nothing, so
    # the router spreads them by load. A stream is running once its first text has come and until it ends (a
    # queued one has no text yet). The router's load signal lags, so a replica may get three (one queued)
    # and another one: the drain starts once four run, which any spread over three replicas of two reaches.
    streams = [Stream(server.url, f"stream {i}: tell me about the tides", DRAIN_TOKENS,
                      {"X-Flotilla-Prefix": f"{i}{'abcdef'[i] * 8}"}) for i in range(6)]

    def running() -> int:
        return sum(s.started.is_set() and s.ended_at is None for s in streams)

    for s in streams:
        s.start()
    poll_until(lambda: running() >= 4, DEADLINE_S, "four streams to run at once")
    assert replica_states() == {"RUNNING": 3}  # the scale-down is from three, whatever ran before
    with cf.ThreadPoolExecutor(1) as pool:  # serve.run may wait for the drain: watch it from here
        asked = time.monotonic()
        deployed = pool.submit(deploy, app_args(tiny_model_dir, num_replicas=1))
        poll_until(lambda: replica_states().get("STOPPING", 0) == 2, DEADLINE_S, "two replicas to start draining")
        draining = time.monotonic()
        # Each replica runs two sequences, so the surviving one runs at most two streams: three or more still
        # running now means the draining replicas are serving streams while they stop.
        now_running = running()
        ended = sorted(round(s.ended_at - asked, 1) for s in streams if s.ended_at is not None)
        assert now_running >= 3, (f"only {now_running} streams ran {draining - asked:.1f} s after the scale-down: "
                                  f"ended {ended}")  # fmt: skip
        deployed.result(DEADLINE_S)
    for s in streams:
        s.join(DEADLINE_S)
    assert [(s.error, s.finish_reason, s.num_tokens) for s in streams] == [(None, "length", DRAIN_TOKENS)] * 6
    wait_replicas(1)
    completion(server.url, "after the scale-down")


def test_autoscaling_up_under_a_burst_and_back_down(server: LiveServer, tiny_model_dir: Path) -> None:
    """Queue pressure adds replicas in proportion (1 -> 3 in one decision); idleness returns
    to the minimum; no request fails on the way up or down."""
    # upscale_delay_s 1: the policy acts once the pressure has held a second, by when all eight streams have
    # queued; with 0 it could act on the first report, taken while the burst was still arriving (2 then 3).
    autoscaling = {"min_replicas": 1, "max_replicas": 3, "target_queue_per_replica": 1,
                   "upscale_delay_s": 1, "downscale_delay_s": 5, "look_back_period_s": 2}
    reshape(tiny_model_dir, 1)  # the burst starts from one replica, whatever ran before
    deploy(app_args(tiny_model_dir, autoscaling=autoscaling))
    wait_replicas(1)
    streams = [Stream(server.url, f"burst {i}", 300) for i in range(8)]
    for s in streams:
        s.start()
    end = time.monotonic() + DEADLINE_S
    # The burst queues 6 behind a batch of 2 (pressure 6): the target goes straight to the
    # maximum, so 3 replicas exist (running or starting) at once, not one more at a time.
    # Serve states each upscale in the deployment's message while its replicas start.
    upscales: set[str] = set()
    while True:
        app = serve.status().applications[APP]
        upscales |= {d.message for d in app.deployments.values() if d.message.startswith("Upscaling")}
        if sum(replica_states(app).values()) >= 3:
            break
        assert time.monotonic() < end, f"never scaled to 3: {replica_states(app)}"
        time.sleep(0.5)  # polling Serve's controller
    assert upscales == {"Upscaling from 1 to 3 replicas."}, upscales
    for s in streams:
        s.join(DEADLINE_S)
    assert [(s.error, s.finish_reason, s.num_tokens) for s in streams] == [(None, "length", 300)] * 8
    wait_replicas(1)
    completion(server.url, "after the scale-down")
