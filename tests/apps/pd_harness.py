"""A disaggregated (``pd``) app of the tiny model beside the package's live app, with named scheduler actors.

A test that kills or stops an actor names its own app (``pd_app``), so the actors
it breaks are its own; tests that only send requests share one (``shared_pd``)
and leave it with every page free: no test depends on what another did to it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ray import serve

from apps.builder import build_app
from tests.serve_harness import ACTOR_NAMESPACE, ENGINE, LiveServer, app_beside, wait_healthy
from tests.shared_ray import SHARED

MIN_TOKENS = 24  # remote_prefill_min_tokens: the tests' long prompts are far above it, "hi" far below
SHARED_PD = "pd"


@dataclass(frozen=True)
class PDServer:
    """A running pd app: ``decode`` is its ingress (and its decode replica's actor), ``prefill`` its prefill
    replica's actor (``prefill.url`` is the ingress too: the prefill pool has no HTTP route)."""

    decode: LiveServer
    prefill: LiveServer

    def assert_pages_free(self, deadline_s: float = 10.0) -> None:
        """No request left and every KV page free or evictable, on the decode and the prefill replica."""
        self.decode.assert_pages_free(deadline_s)
        self.prefill.assert_pages_free(deadline_s)


def shared_pd(live: LiveServer, model_dir: Path) -> PDServer:
    """The session's plain pd app (``pd``), deployed beside ``live`` on first use and kept while the shared
    cluster runs (``tests.shared_ray``): for tests that only send it requests and leave every page free. Its
    prefill replica computes 32 tokens a step, so a long prompt takes many prefill steps (the disconnect
    storm's hang-ups land all along its submit)."""
    found = SHARED.apps.get(SHARED_PD)
    if isinstance(found, PDServer) and SHARED.running:
        return found
    # No CPU held: the cluster's 4 keep room, as before this app was shared, for the tiny app, a test's own pd
    # app and a shard group a fault test leaks (tests/apps/replica/test_faults.py).
    small = {"replica_options": {"num_cpus": 0}}
    args, prefill_actor, decode_actor = _pd_args(model_dir, SHARED_PD, prefill={"max_num_batched_tokens": 32, **small})
    args.update(small)
    serve.run(build_app(args), name=SHARED_PD, route_prefix=f"/{SHARED_PD}")
    url = f"{live.url}/{SHARED_PD}"
    wait_healthy(url)
    SHARED.apps[SHARED_PD] = server = PDServer(LiveServer(url, decode_actor, SHARED_PD),
                                               LiveServer(url, prefill_actor, SHARED_PD))
    return server


@contextlib.contextmanager
def pd_app(live: LiveServer, model_dir: Path, app: str, *, prefill: dict[str, Any] | None = None,
           decode: dict[str, Any] | None = None, **pd_options: Any) -> Iterator[PDServer]:
    """``app`` with one replica per pool, deployed beside ``live`` and healthy; deleted on exit.

    ``prefill``/``decode``: extra pool settings; ``pd_options``: other keys of ``pd``.
    """
    args, prefill_actor, decode_actor = _pd_args(model_dir, app, prefill=prefill, decode=decode, **pd_options)
    with app_beside(live, args, app, decode_actor) as server:
        yield PDServer(server, LiveServer(server.url, prefill_actor, app))


def _pd_args(model_dir: Path, app: str, *, prefill: dict[str, Any] | None = None,
             decode: dict[str, Any] | None = None, **pd_options: Any) -> tuple[dict[str, Any], str, str]:
    """``build_app`` arguments of pd app ``app``, and the names of its prefill and decode scheduler actors."""
    named = {"namespace": ACTOR_NAMESPACE}
    prefill_actor, decode_actor = f"{app}-prefill-scheduler", f"{app}-decode-scheduler"
    pd = {"remote_prefill_min_tokens": MIN_TOKENS, **pd_options,
          "prefill": {"scheduler_options": {"name": prefill_actor, **named}, **(prefill or {})},
          "decode": dict(decode or {})}
    args = {**ENGINE, "model": str(model_dir), "served_model_name": "tiny", "num_replicas": 1,
            "scheduler_options": {"name": decode_actor, **named}, "pd": pd}
    return args, prefill_actor, decode_actor
