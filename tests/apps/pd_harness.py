"""A disaggregated (``pd``) app of the tiny model beside the package's live app, with named scheduler actors.

Each caller names its own app, so the actors it may kill or load are its own:
no test depends on what another did to a shared app.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.serve_harness import ACTOR_NAMESPACE, ENGINE, LiveServer, app_beside

MIN_TOKENS = 24  # remote_prefill_min_tokens: the tests' long prompts are far above it, "hi" far below


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


@contextlib.contextmanager
def pd_app(live: LiveServer, model_dir: Path, app: str, *, prefill: dict[str, Any] | None = None,
           decode: dict[str, Any] | None = None, **pd_options: Any) -> Iterator[PDServer]:
    """``app`` with one replica per pool, deployed beside ``live`` and healthy; deleted on exit.

    ``prefill``/``decode``: extra pool settings; ``pd_options``: other keys of ``pd``.
    """
    named = {"namespace": ACTOR_NAMESPACE}
    prefill_actor, decode_actor = f"{app}-prefill-scheduler", f"{app}-decode-scheduler"
    pd = {"remote_prefill_min_tokens": MIN_TOKENS, **pd_options,
          "prefill": {"scheduler_options": {"name": prefill_actor, **named}, **(prefill or {})},
          "decode": dict(decode or {})}
    args = {**ENGINE, "model": str(model_dir), "served_model_name": "tiny", "num_replicas": 1,
            "scheduler_options": {"name": decode_actor, **named}, "pd": pd}
    with app_beside(live, args, app, decode_actor) as server:
        yield PDServer(server, LiveServer(server.url, prefill_actor, app))
