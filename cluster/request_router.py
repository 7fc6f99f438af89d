"""``PrefixAwareRequestRouter``: Ray Serve 2.60's RequestRouter with prefix affinity.

Serve runs one router per deployment handle; for HTTP traffic that is inside
the proxy actor. Each ``choose_replicas`` call ranks replicas for one pending
request: the ``PrefixRouterCore`` pick first (longest approximate prefix match,
unless its queue exceeds the least-loaded replica's by the imbalance threshold,
then power of two choices), every other replica next, shortest queue first, so
Serve still has somewhere to go if the pick refuses. The prompt is recorded
under the pick when it is chosen.

What the router reads from a pending request (a prompt, a session, an
adapter, a stored response's id) is ``cluster.pending_requests``'s.

A request about a stored response (``GET``/``DELETE /v1/responses/<id>``, or
``POST /v1/responses`` with ``X-Flotilla-Previous-Response: <id>``) goes first of all to the replica that
holds it (``cluster.response_ids``), which alone can answer it.

LoRA adapters come first: a request that names a model (``X-Flotilla-Model``,
which the SDK sends, or ``model`` in a handle caller's body) goes to the
least loaded replica that reports that adapter loaded (``ROUTING_LORAS`` in
its routing stats), unless that one's queue exceeds the least loaded
replica's by the imbalance threshold; with no such replica, to the least
loaded one, which then loads it (``apps.replica.lora``). A replica
reports its adapters every stats period, so the router also counts a replica
it sent the adapter to as holding it (for the prefix TTL): requests that
arrive before the report follow the first one instead of loading it
everywhere. The prompt is still
recorded under the pick. A plain OpenAI client sends no such header unless
asked (``default_headers``): its adapter requests are routed on the prompt.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from cluster.pending_requests import (
    RequestArg,
    RoutingKey,
    request_key,
    request_model,
    request_owner,
)
from cluster.routing import PrefixRouterCore
from scheduling.errors import InvalidParameterError

# The keys ``ReplicaStats.record_routing_stats`` reports the replica's loaded LoRA adapters and
# its base model's served name under (a request for the base model is no adapter request).
ROUTING_LORAS = "loras"
ROUTING_SERVED_MODEL = "served_model"
# request_router_kwargs key: the base model's served name in an app that serves adapters.
LORA_BASE_MODEL = "lora_base_model"
# The key ``ReplicaStats.record_routing_stats`` reports requests open on a replica under, and the one
# naming that report (its time): picks made since a replica's last report count on top of its figure.
ROUTING_NUM_OPEN = "num_open"
ROUTING_REPORTED_AT = "reported_at"
ROUTER_CLASS = "cluster.request_router:PrefixAwareRequestRouter"
_SESSION_KEY_CHARS = 64  # sha256 hex: sessions match whole or not at all


class PrefixRouting:
    """The router's decisions on plain replica ids and loads (no Serve objects: unit-testable).

    Two cores: prompts match by longest prefix (at least ``min_match_chars``);
    sessions match only whole (a hashed id).
    """

    def __init__(self, *, imbalance_threshold: float = 8.0, ttl_s: float = 600.0,
                 max_chars_per_replica: int = 1_000_000, min_match_chars: int = 64,
                 seed: int | None = None) -> None:
        self.prompts = PrefixRouterCore(
            max_chars_per_replica=max_chars_per_replica, ttl_s=ttl_s,
            imbalance_threshold=imbalance_threshold, min_match_chars=min_match_chars, seed=seed)
        self.sessions = PrefixRouterCore(
            max_chars_per_replica=max_chars_per_replica, ttl_s=ttl_s,
            imbalance_threshold=imbalance_threshold, min_match_chars=_SESSION_KEY_CHARS, seed=seed)
        self.ttl_s = ttl_s
        # adapter -> {replica: when this router last sent a request for it there}
        self.adapters_sent: dict[str, dict[str, float]] = {}

    def adapter_holders(self, model: str, reported: frozenset[str], now: float) -> frozenset[str]:
        """The replicas that report ``model`` loaded, and those this router sent it to within the TTL."""
        sent = self.adapters_sent.get(model, {})
        return reported | frozenset(r for r, t in sent.items() if now - t <= self.ttl_s)

    def record_adapter(self, model: str, replica_id: str, now: float) -> None:
        """``model``'s request went to ``replica_id``, which loads it on arrival if it had not."""
        self.adapters_sent.setdefault(model, {})[replica_id] = now

    def rank(self, key: RoutingKey | None, loads: Mapping[str, float], now: float,
             adapter_on: frozenset[str] | None = None) -> list[list[str]]:
        """``[[pick], [the others, shortest queue first]]`` (the second rank only if non-empty).

        ``adapter_on``: for a request naming a LoRA adapter, the replicas that
        have it loaded (maybe none); None for other requests.
        """
        if not loads:
            return []
        ids = list(loads)
        if adapter_on is not None:
            first = self._adapter_pick(adapter_on, loads)
        elif key is None:
            first = self.prompts.power_of_two(ids, loads)
        else:
            first = self._core(key).choose(key.text, loads, now)
        rest = sorted((r for r in ids if r != first), key=lambda r: loads[r])
        return [[first], rest] if rest else [[first]]

    def _adapter_pick(self, adapter_on: frozenset[str], loads: Mapping[str, float]) -> str:
        """The least loaded replica with the adapter, within the imbalance bound; else the least loaded."""
        least = min(loads, key=lambda r: loads[r])
        holders = [r for r in loads if r in adapter_on]
        if not holders:
            return least
        best = min(holders, key=lambda r: loads[r])
        return best if loads[best] - loads[least] <= self.prompts.imbalance_threshold else least

    def record(self, key: RoutingKey | None, replica_id: str, now: float) -> None:
        """Remember that ``key`` went to ``replica_id`` (no-op for unkeyed requests)."""
        if key is not None:
            self._core(key).record(replica_id, key.text, now)

    def forget_missing(self, live_ids: set[str]) -> None:
        """Drop what is known of replicas that left the fleet (removed or draining)."""
        self.prompts.forget_missing(live_ids)
        self.sessions.forget_missing(live_ids)
        for sent in self.adapters_sent.values():
            for rid in [r for r in sent if r not in live_ids]:
                del sent[rid]

    def _core(self, key: RoutingKey) -> PrefixRouterCore:
        return self.prompts if key.kind == "prompt" else self.sessions


def replica_key(replica_id: ReplicaID) -> str:
    """The core's name for a Serve replica."""
    return str(replica_id.unique_id)


class PrefixAwareRequestRouter(RequestRouter):
    """Serve's hook around ``PrefixRouting``; configure through ``request_router_kwargs``.

    Deployment option::

        request_router_config=RequestRouterConfig(
            request_router_class="cluster.request_router:PrefixAwareRequestRouter",
            request_router_kwargs={"imbalance_threshold": 8, "ttl_s": 600},
            request_routing_stats_period_s=2)
    """

    _routing: PrefixRouting
    # Requests this router sent that Serve has not reported completed, per replica:
    # exact for this router's own traffic, with no reporting lag.
    _num_inflight: dict[str, int]
    # The base model's served name when the app serves LoRA adapters (None: read from the replicas' stats).
    _lora_base_model: str | None
    # Picks Serve never reports as sent (HAProxy's ingress router picks without dispatching,
    # cluster.ingress_router), per replica: (the report they follow, how many). Without them every
    # request of a burst would see the same stale figures.
    _unreported: dict[str, tuple[object, int]]

    def initialize_state(self, **kwargs: Any) -> None:
        """Called by Serve with ``request_router_kwargs``: ``PrefixRouting``'s keywords, and
        ``LORA_BASE_MODEL`` when the app serves adapters."""
        self._lora_base_model = kwargs.pop(LORA_BASE_MODEL, None)
        self._routing = PrefixRouting(**kwargs)
        self._num_inflight = {}
        self._unreported = {}

    def _state(self) -> PrefixRouting:
        if not hasattr(self, "_routing"):  # Serve calls initialize_state; a bare construction may not
            self.initialize_state()
        return self._routing

    def replica_load(self, replica: RunningReplica) -> float:
        """Requests on ``replica``: what this router has in flight there (or Serve's cached
        queue length, if larger); for a replica it never sent to, its last routing stats plus
        the picks made since that report."""
        self._state()
        rid = replica_key(replica.replica_id)
        cached = self.replica_queue_len_cache.get(replica.replica_id)
        if rid in self._num_inflight or cached is not None:
            return float(max(self._num_inflight.get(rid, 0), cached or 0))
        stats = replica.routing_stats or {}
        report, picks = self._unreported.get(rid, (None, 0))
        since = picks if report == stats.get(ROUTING_REPORTED_AT) else 0
        return float(stats.get(ROUTING_NUM_OPEN, 0.0)) + since

    def _count_pick(self, replica: RunningReplica) -> None:
        """``replica`` was picked: one more request on it until its next report says otherwise."""
        rid = replica_key(replica.replica_id)
        report = (replica.routing_stats or {}).get(ROUTING_REPORTED_AT)
        last, picks = self._unreported.get(rid, (None, 0))
        self._unreported[rid] = (report, picks + 1 if last == report else 1)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        """Ranks for one request: the affinity (or p2c) pick, then everyone else."""
        by_id = {replica_key(r.replica_id): r for r in candidate_replicas}
        loads = {rid: self.replica_load(r) for rid, r in by_id.items()}
        arg = RequestArg.of(pending_request.args, pending_request.kwargs) if pending_request else None
        key = None if arg is None else request_key(arg)
        model = None if arg is None else request_model(arg)
        adapter_on = None
        stats = [r.routing_stats or {} for r in candidate_replicas]
        now = time.monotonic()
        # An adapter request: the app serves adapters and the model is not the base model's served
        # name (known from the build, else from what the replicas report).
        base = self._lora_base_model
        if model is not None and (model != base if base is not None else (
            any(ROUTING_LORAS in s for s in stats) and all(s.get(ROUTING_SERVED_MODEL) != model for s in stats)
        )):
            reported = frozenset(rid for rid, r in by_id.items()
                                 if model in ((r.routing_stats or {}).get(ROUTING_LORAS) or ()))  # fmt: skip
            adapter_on = self._state().adapter_holders(model, reported, now)
        ranks = self._state().rank(key, loads, now, adapter_on)
        owner = None if arg is None else request_owner(arg)
        if owner is not None and owner in by_id:  # the replica holding the response, however loaded
            rest = sorted((rid for rid in by_id if rid != owner), key=lambda rid: loads[rid])
            ranks = [[owner], rest] if rest else [[owner]]
        if ranks:
            # Recorded at choice time: Serve 2.60 calls on_request_routed only on its
            # strict-queue path, and the first rank is refused only when a replica is
            # full (then the tree is briefly wrong about one prompt: harmless).
            self._state().record(key, ranks[0][0], now)
            self._count_pick(by_id[ranks[0][0]])
            if adapter_on is not None and model is not None:
                self._state().record_adapter(model, ranks[0][0], now)
        if pending_request is not None:
            # Every candidate is ranked: if all refuse, back off before trying again.
            pending_request.routing_context.should_backoff = True
        return [[by_id[rid] for rid in rank] for rank in ranks]

    def on_send_request(self, replica_id: ReplicaID) -> None:
        """Serve sent a request to ``replica_id``: it counts as load until completed."""
        super().on_send_request(replica_id)
        self._state()
        rid = replica_key(replica_id)
        self._num_inflight[rid] = self._num_inflight.get(rid, 0) + 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """A request ended on ``replica_id`` (any outcome): it no longer counts as load."""
        self._state()
        rid = replica_key(replica_id)
        if self._num_inflight.get(rid, 0) > 0:
            self._num_inflight[rid] -= 1

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Serve's replica set changed: forget replicas that left (a draining one included)."""
        super().update_replicas(replicas)
        live = {replica_key(r.replica_id) for r in replicas}
        self._state().forget_missing(live)
        for gone in (self._num_inflight, self._unreported):
            for rid in [r for r in gone if r not in live]:
                del gone[rid]


def router_config(options: Mapping[str, Any] | str | None,
                  lora_base_model: str | None = None) -> dict[str, Any] | None:
    """``request_router_config`` for a deployment from the app's ``request_router`` argument.

    ``"prefix"`` (or a dict ``{"kind": "prefix", <PrefixRouting keywords>,
    "stats_period_s": 2}``) selects this router, and so does None (the
    default: requests that share a prompt's start go where it is cached);
    ``"default"`` keeps Serve's power of two choices. Invalid keywords fail
    here, at build time.
    """
    opts: dict[str, Any] = dict(options) if isinstance(options, Mapping) else {"kind": options or "prefix"}
    kind = opts.pop("kind", "prefix")
    if kind == "default":
        return None
    if kind != "prefix":
        raise InvalidParameterError("request_router", f"must be 'prefix' or 'default', got {kind!r}")
    period = float(opts.pop("stats_period_s", 2.0))
    try:
        PrefixRouting(**opts)
    except (TypeError, ValueError) as exc:
        raise InvalidParameterError("request_router", str(exc)) from exc
    if lora_base_model is not None:  # the router's own keyword, beside PrefixRouting's
        opts[LORA_BASE_MODEL] = lora_base_model
    return {"request_router_class": ROUTER_CLASS, "request_router_kwargs": opts,
            "request_routing_stats_period_s": period}
