"""The soak's cluster side: start Ray + Serve with the flotilla app, find and kill its actors,
read their memory and KV pages.

Actors are found without the dashboard: Serve names its replicas
(``SERVE_REPLICA::<app>#...``), each replica's ``LLMServer`` holds its
SchedulerActor handle (read through Ray's ``__ray_call__``), and each
scheduler's executor lists its shards. Kills are ``ray.kill(no_restart=True)``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import ray
from ray import cloudpickle, serve
from ray.util import placement_group_table

APP = "soak"
# The closures sent with __ray_call__ come from this file, which workers cannot import.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
CALL_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Replica:
    """One live replica: its Serve actor, its scheduler and their process ids."""

    key: str  # the replica actor's id (stable while it lives)
    actor: Any
    scheduler: Any
    pid: int
    scheduler_pid: int


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def cluster(model: str, *, num_replicas: int, num_cpus: int, engine: dict[str, Any]) -> Iterator[str]:
    """A local Ray cluster serving ``model`` at the returned base URL; torn down on exit."""
    from ray.serve import Application

    from apps.builder import build_app

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        args = {"model": model, "served_model_name": "tiny", "num_replicas": num_replicas,
                "replica_options": {"num_cpus": 0}, "executor": "ray", **engine}
        built = build_app(args)
        # build_app's application, with a 1 s health check so a replica whose scheduler died goes fast.
        app = Application(cast(Any, built)._bound_deployment.options(health_check_period_s=1.0))
        serve.run(app, name=APP, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()


def _scheduler_of(replica: Any) -> Any:
    return replica._replica_impl._user_callable_wrapper._callable._scheduler.actor  # an ActorScheduler's


def replicas(timeout_s: float = 3.0) -> list[Replica]:
    """Every replica that answers within ``timeout_s`` (one starting or dying is skipped).

    The replicas are asked at once, so one stuck in ``__init__`` costs the timeout once.
    """
    actors: list[Any] = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["name"].startswith(f"SERVE_REPLICA::{APP}#"):
            with contextlib.suppress(ValueError):  # gone between the listing and the lookup
                actors.append(ray.get_actor(entry["name"], namespace=entry["namespace"]))
    firsts = {a.__ray_call__.remote(lambda r: (os.getpid(), _scheduler_of(r))): a for a in actors}
    if not firsts:
        return []
    ready, _ = ray.wait(list(firsts), num_returns=len(firsts), timeout=timeout_s)
    answered: dict[Any, tuple[Any, int, Any]] = {}
    for ref in ready:
        with contextlib.suppress(Exception):  # died meanwhile
            pid, scheduler = ray.get(ref)
            answered[scheduler.__ray_call__.remote(lambda s: os.getpid())] = (firsts[ref], pid, scheduler)
    found: list[Replica] = []
    if not answered:
        return found
    ready, _ = ray.wait(list(answered), num_returns=len(answered), timeout=timeout_s)
    for ref in ready:
        with contextlib.suppress(Exception):
            actor, pid, scheduler = answered[ref]
            found.append(Replica(actor._actor_id.hex(), actor, scheduler, pid, int(ray.get(ref))))
    return found


def shards(replica: Replica) -> list[Any]:
    return list(ray.get(replica.scheduler.__ray_call__.remote(
        lambda s: list(getattr(s._engine.executor, "shards", []))), timeout=CALL_TIMEOUT_S))


def kill(kind: str, replica: Replica) -> str:
    """Kill the replica, its scheduler or one of its shards; returns what was killed."""
    if kind == "replica":
        ray.kill(replica.actor, no_restart=True)
        return f"replica {replica.key[:8]}"
    if kind == "scheduler":
        ray.kill(replica.scheduler, no_restart=True)
        return f"scheduler of {replica.key[:8]}"
    group = shards(replica)
    if not group:
        raise LookupError("no shard to kill (the executor is restarting)")
    ray.kill(group[0], no_restart=True)
    return f"shard 0 of {replica.key[:8]}"


def rss_bytes(pid: int) -> int | None:
    """Resident set size of a local process, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=CALL_TIMEOUT_S) as resp:
            return bool(resp.status == 200)
    except (OSError, urllib.error.HTTPError):
        return False


def settle(url: str, num_replicas: int, timeout_s: float) -> list[Replica]:
    """Wait (bounded) until ``num_replicas`` replicas answer and each scheduler reports healthy."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = replicas()
        if len(found) == num_replicas and healthy(url):
            statuses = []
            for r in found:
                with contextlib.suppress(Exception):
                    statuses.append(ray.get(r.scheduler.health.remote(), timeout=CALL_TIMEOUT_S).ok)
            if statuses == [True] * num_replicas:
                return found
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(found)} of {num_replicas} replicas healthy after {timeout_s:.0f} s")


def page_report(found: list[Replica], timeout_s: float) -> dict[str, Any]:
    """Per scheduler: no request left, no page locked, every page free or evictable (bounded wait)."""
    report: dict[str, Any] = {"ok": True, "schedulers": []}
    for r in found:
        deadline = time.monotonic() + timeout_s
        while True:
            s = ray.get(r.scheduler.stats.remote(), timeout=CALL_TIMEOUT_S)
            clean = (s.num_unfinished_requests == 0 and s.num_kv_pages_locked == 0
                     and s.num_kv_pages_free + s.num_kv_pages_evictable == s.num_kv_pages_total)
            if clean or time.monotonic() > deadline:
                break
        report["schedulers"].append({"replica": r.key[:8], "clean": clean, "unfinished": s.num_unfinished_requests,
                                     "locked": s.num_kv_pages_locked, "free": s.num_kv_pages_free,
                                     "evictable": s.num_kv_pages_evictable, "total": s.num_kv_pages_total})
        report["ok"] = report["ok"] and clean
    return report


def live_placement_groups() -> int:
    """Placement groups that still hold resources (each live scheduler owns one for its shards)."""
    table = placement_group_table()
    return sum(1 for info in table.values() if info.get("state") not in ("REMOVED",))
