"""Serve apps of the tiny model on the session's shared local Ray cluster, on a free loopback port.

Shared by every test module that talks HTTP to flotilla (``tests/apps``,
``tests/flotilla``, ``tests/cluster``, the benchmarks'): ``shared_tiny`` is the
session's plain tiny app, deployed once; ``live_server`` and ``app_beside``
deploy an app of a test's own beside it (``build_app``'s, at ``/<name>``),
healthy (``/health`` answers 200), deleted on exit. The cluster and Serve are
``tests.shared_ray``'s (token auth off for that private cluster).
"""

from __future__ import annotations

import contextlib
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import ray
from ray import serve

from actors.api import EngineStats
from apps.builder import build_app
from tests.shared_ray import SHARED

# One forward thread: the tests' servers share two cores with pytest and each other, and a
# tiny model's matmuls gain nothing from a second thread there (actors/remote/cpu_threads.py).
ENGINE: dict[str, Any] = {"max_model_len": 2048, "max_num_seqs": 16, "max_num_batched_tokens": 512,
                          "num_kv_pages": 256, "dtype": "float32", "device": "cpu", "cpu_threads": 1}
ACTOR_NAMESPACE = "flotilla-test-server"
TIMEOUT = 60.0
POLL_START_S, POLL_MAX_S = 0.005, 0.1  # poll_until's backoff


def http(url: str, body: bytes | dict[str, Any] | None = None,
         headers: dict[str, str] | None = None, method: str | None = None) -> tuple[int, Any]:
    """``(status, parsed JSON)`` of a GET (no body) or POST, or of ``method``."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})},
                                 method=method)
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@dataclass(frozen=True)
class LiveServer:
    """A running app: its base URL and the name of its (single) replica's scheduler actor."""

    url: str
    actor_name: str | None  # None: the scheduler runs in the replica (scheduler_placement=replica)
    app_name: str = "flotilla"

    def stats(self) -> EngineStats:
        if self.actor_name is None:
            handle = serve.get_app_handle(self.app_name)
            return cast(EngineStats, handle.engine_stats.remote().result(timeout_s=TIMEOUT))
        actor = ray.get_actor(self.actor_name, namespace=ACTOR_NAMESPACE)
        return cast(EngineStats, ray.get(actor.stats.remote(), timeout=TIMEOUT))

    def assert_pages_free(self, deadline_s: float = 10.0) -> None:
        """Within ``deadline_s`` no request is in flight and every KV page is free or evictable."""
        last: list[EngineStats] = []

        def freed() -> bool:
            s = self.stats()
            last[:] = [s]
            return (s.num_unfinished_requests == 0 and s.num_kv_pages_locked == 0
                    and s.num_kv_pages_free + s.num_kv_pages_evictable == s.num_kv_pages_total)

        poll_until(freed, deadline_s, lambda: f"KV pages not freed: {last}")


def poll_until(check: Callable[[], bool], timeout_s: float, what: str | Callable[[], str]) -> None:
    """Call ``check`` until it is true; fail with ``what`` after ``timeout_s``.

    Between calls it sleeps 5 ms, doubling to 100 ms: a server that needs a
    moment is seen within ~100 ms, and a poller never takes a core from it
    (the tests share two cores with the servers they poll).
    """
    deadline = time.monotonic() + timeout_s
    delay = POLL_START_S
    while not check():
        if time.monotonic() >= deadline:
            raise AssertionError(what() if callable(what) else f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(delay * 2, POLL_MAX_S)


def wait_healthy(url: str, timeout_s: float = TIMEOUT) -> None:
    def healthy() -> bool:
        with contextlib.suppress(OSError, ValueError):  # not listening, or a non-JSON 404 yet
            return http(f"{url}/health")[0] == 200
        return False

    poll_until(healthy, timeout_s, f"{url} to become healthy")


@contextlib.contextmanager
def app_beside(live: LiveServer, args: dict[str, Any], app: str, actor: str | None) -> Iterator[LiveServer]:
    """``build_app(args)`` deployed as ``app`` at ``/app`` on ``live``'s cluster (the session's shared one),
    healthy; deleted on exit. ``actor``: its scheduler actor's name (None when it lives in the replica)."""
    serve.run(build_app(args), name=app, route_prefix=f"/{app}")
    try:
        url = f"{live.url}/{app}"
        wait_healthy(url)
        yield LiveServer(url, actor, app)
    finally:
        serve.delete(app)


def shared_tiny(model_dir: Path) -> LiveServer:
    """The session's tiny app: one replica of ``model_dir``, app ``flotilla`` at ``/``, its scheduler actor
    named ``scheduler``, on the shared cluster (``tests.shared_ray``), deployed on first use and healthy.

    Every test that only talks to a plain tiny app uses it (``tests/apps``, the SDK's, the benchmarks' and
    the metrics' live tests), and leaves it as it found it: no request in flight and every KV page free
    (``assert_pages_free``), nothing killed or reconfigured (a test that breaks things deploys its own app
    beside it: ``app_beside``, ``live_server``). It goes when the shared cluster stops.
    """
    found = SHARED.apps.get("flotilla")
    if isinstance(found, LiveServer) and SHARED.running:
        return found
    url = SHARED.serve_url()
    args = {"model": str(model_dir), "served_model_name": "tiny", "num_replicas": 1,
            "scheduler_options": {"name": "scheduler", "namespace": ACTOR_NAMESPACE}, **ENGINE}
    serve.run(build_app(args), name="flotilla", route_prefix="/")
    wait_healthy(url)
    SHARED.apps["flotilla"] = live = LiveServer(url, "scheduler")
    return live


@contextlib.contextmanager
def live_server(model_dir: Path, app: str, actor_name: str | None = None, **app_args: Any) -> Iterator[LiveServer]:
    """App ``app`` at ``/app`` with one replica of ``model_dir`` (extra ``app_args`` go to ``build_app``) on the
    session's shared cluster (``tests.shared_ray``), beside the tiny app; deleted on exit.

    The replica's scheduler actor is named ``actor_name`` (``<app>-scheduler`` by default), unless
    ``app_args`` place the scheduler in the replica (``scheduler_placement="replica"``).
    """
    url = SHARED.serve_url()
    in_replica = app_args.get("scheduler_placement") == "replica"
    actor = None if in_replica else actor_name or f"{app}-scheduler"
    named = {} if in_replica else {"scheduler_options": {"name": actor, "namespace": ACTOR_NAMESPACE}}
    args = {"model": str(model_dir), "served_model_name": "tiny", "num_replicas": 1, **named, **ENGINE, **app_args}
    with app_beside(LiveServer(url, None), args, app, actor) as server:
        yield server
