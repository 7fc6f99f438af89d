"""One pool of simulated replicas: who takes the next request (the router), how many there are (the policy).

A colocated fleet has one pool; a disaggregated one a ``prefill`` and a
``decode`` pool, each with its own ``AutoscalingConfig`` (``pool`` set, so
``decide`` reads that pool's signals, as the real per-pool policy does).
The fleet (``cli.simulate.fleet``) owns time and events; a pool owns its
replicas, its router, its policy state and the requests waiting for a
replica to be ready.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Literal

from cli.simulate.profile import StepProfile
from cli.simulate.replica import SimReplica
from cluster.autoscaling import PolicyState, decide
from cluster.autoscaling_pools import AutoscalingConfig
from cluster.routing import PrefixRouterCore

Policy = Literal["flotilla", "default"]
SERVE_DEFAULT_UPSCALE_DELAY_S = 30.0  # Ray Serve's AutoscalingConfig defaults
SERVE_DEFAULT_DOWNSCALE_DELAY_S = 600.0


@dataclass
class ScaleEvent:
    t: float
    pool: str
    replicas: int
    reason: str


@dataclass(frozen=True, slots=True)
class Work:
    """A request on its way to a pool: a whole request, or (``first_token_at`` set) one prefilled elsewhere
    whose KV this pool imports before decoding the rest."""

    rid: str
    arrival: float
    prompt_tokens: int
    output_tokens: int
    first_token_at: float | None = None


@dataclass
class Pool:
    """Replicas of one role, their router and their policy (module docstring)."""

    name: str
    profile: StepProfile
    autoscaling: AutoscalingConfig
    policy: Policy
    target_ongoing_requests: float
    seed: int = 0
    replicas: list[SimReplica] = field(default_factory=list)
    pending: list[Work] = field(default_factory=list)  # arrived while no replica was ready
    events: list[ScaleEvent] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.router = PrefixRouterCore(seed=self.seed)
        self._names = itertools.count()
        self._state = PolicyState()
        self._default_since: tuple[int, float] | None = None  # the default policy's (direction, since)

    def add_replica(self, now: float, ready_at: float) -> SimReplica:
        replica = SimReplica(f"{self.name}{next(self._names)}", self.profile, started=now, ready_at=ready_at)
        self.replicas.append(replica)
        return replica

    def live(self) -> list[SimReplica]:
        """Replicas asked for and not draining (the count the policy steers)."""
        return [r for r in self.replicas if r.stopped is None and not r.draining]

    @property
    def open_requests(self) -> int:
        return sum(r.open_requests for r in self.replicas) + len(self.pending)

    def place(self, work: Work, now: float) -> SimReplica | None:
        """Hand ``work`` to the replica the router picks (the power of two choices over open requests: a
        trace has no text to match); None while no replica is ready (it waits in ``pending``)."""
        candidates = [r for r in self.live() if r.ready_at <= now]
        if not candidates:
            self.pending.append(work)
            return None
        by_name = {r.name: r for r in candidates}
        replica = by_name[self.router.choose("", {r.name: float(r.open_requests) for r in candidates}, now)]
        if work.first_token_at is None:
            replica.add(work.rid, work.prompt_tokens, work.output_tokens, work.arrival)
        else:
            replica.add_prefilled(work.rid, work.prompt_tokens, work.output_tokens, work.arrival,
                                  work.first_token_at)
        return replica

    def stop_if_drained(self, replica: SimReplica, now: float) -> None:
        if replica.draining and not replica.tracked and replica.busy_until is None and replica.stopped is None:
            replica.stopped = now
            self.router.remove_replica(replica.name)

    # ---------------------------------------------------------------- policy
    def _desired(self, now: float) -> tuple[int, str]:
        live = self.live()
        n = len(live)
        cfg = self.autoscaling
        if self.policy == "flotilla":
            decision = decide(cfg, n, [r.load(now) for r in live if r.ready_at <= now], now, self._state)
            self._state = decision.state
            return decision.desired_replicas, decision.reason
        ongoing = self.open_requests
        wanted = min(cfg.max_replicas, max(cfg.min_replicas, math.ceil(ongoing / self.target_ongoing_requests)))
        if wanted == n:
            self._default_since = None
            return n, "hold"
        # Serve counts consecutive decisions in one direction (its decision counter), not of one target:
        # once the delay has passed it applies the latest target.
        direction = 1 if wanted > n else -1
        since = self._default_since[1] if self._default_since and self._default_since[0] == direction else now
        self._default_since = (direction, since)
        delay = SERVE_DEFAULT_UPSCALE_DELAY_S if wanted > n else SERVE_DEFAULT_DOWNSCALE_DELAY_S
        if now - since < delay:
            return n, f"want {wanted}, waiting"
        self._default_since = None
        return wanted, f"{ongoing} ongoing / {self.target_ongoing_requests}"

    def scale(self, now: float, startup_s: float) -> list[SimReplica]:
        """Apply the policy's count now; the replicas added (ready ``startup_s`` later)."""
        live = self.live()
        target, reason = self._desired(now)
        added: list[SimReplica] = []
        if target > len(live):
            added = [self.add_replica(now, now + startup_s) for _ in range(target - len(live))]
        elif target < len(live):
            # Drain the emptiest first; one still starting costs nothing to drop.
            for replica in sorted(live, key=lambda r: (r.ready_at <= now, r.open_requests))[: len(live) - target]:
                replica.draining = True
                self.stop_if_drained(replica, now)
        if not live and self.pending and not added:  # Serve starts a replica for a request queued at zero
            added = [self.add_replica(now, now + startup_s)]
            target, reason = 1, "scale from zero: a request waits"
        if target != len(live):
            self.events.append(ScaleEvent(round(now, 3), self.name, target, reason))
        return added
