"""The discrete-event simulation of a fleet: arrivals, the router, replicas' steps and the autoscaler.

Simulated time only: nothing sleeps, so an hour of traffic takes as long as
its scheduler work. Events, in time order (ties: in the order queued):

- an **arrival** goes through the real router's choice
  (``cluster.routing.PrefixRouterCore.choose``; a trace carries no text, so it
  is always the power of two choices over the replicas' open requests, the
  load figure real replicas report) to a ready replica that is not draining;
  with none ready (all still starting) it waits at the proxy, as Serve's
  handle queues it, and goes out when one is;
- a replica's **step end** applies the step (``SimReplica``) and starts the
  next one at once if there is work;
- a **tick** (every ``tick_s``) reads every ready replica's load and asks the
  policy for a replica count: ``flotilla`` is ``cluster.autoscaling.decide``
  with its delays and hysteresis; ``default`` is Ray Serve's
  ongoing-requests rule (``ceil(total ongoing / target_ongoing_requests)``,
  the change held for ``upscale_delay_s`` / ``downscale_delay_s``, Serve's
  defaults 30 s and 600 s). Up: new replicas are ready ``startup_s`` later.
  Down: the replica with the fewest open requests drains (no new requests)
  and stops when it has none, as Serve's graceful shutdown does.

Replica-seconds count from when a replica is asked for until it stops. The
run goes on after the last answer until the policy has scaled back to its
minimum (the idle replicas of a slow scale-down are a real cost), bounded by
``MAX_TAIL_S`` past the last arrival; requests still open then are
unfinished.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field
from typing import Literal

from cli.bench.stream_client import RequestResult
from cli.simulate.profile import StepProfile
from cli.simulate.replica import SimReplica
from cli.simulate.trace import Arrival
from cluster.autoscaling import PolicyState, decide
from cluster.autoscaling_pools import AutoscalingConfig
from cluster.routing import PrefixRouterCore
from scheduling.errors import InvalidParameterError

Policy = Literal["flotilla", "default"]
SERVE_DEFAULT_UPSCALE_DELAY_S = 30.0  # Ray Serve's AutoscalingConfig defaults
SERVE_DEFAULT_DOWNSCALE_DELAY_S = 600.0
MAX_TAIL_S = 3600.0  # simulated time past the last arrival after which requests still open are unfinished


@dataclass(frozen=True)
class FleetConfig:
    """How the fleet runs: the policy and its settings, start-up time, control-loop period."""

    policy: Policy = "flotilla"
    autoscaling: AutoscalingConfig = field(default_factory=AutoscalingConfig)
    target_ongoing_requests: float = 2.0  # the default policy's target per replica
    startup_s: float = 30.0  # from the scale-up decision to a replica taking requests
    tick_s: float = 1.0
    initial_replicas: int | None = None  # None: min_replicas (at least 1)
    # Replicas sharing one host's CPU cores (a CPU machine; None: each replica has its own device): a step
    # that starts while b replicas are stepping takes max(1, b / host_cores) times the profile's time.
    host_cores: float | None = None

    def __post_init__(self) -> None:
        if self.policy not in ("flotilla", "default"):
            raise InvalidParameterError("policy", f"must be flotilla or default, got {self.policy!r}")
        if self.host_cores is not None and not (self.host_cores > 0 and math.isfinite(self.host_cores)):
            raise InvalidParameterError("host_cores", f"must be a positive number, got {self.host_cores!r}")
        for name in ("startup_s", "tick_s", "target_ongoing_requests"):
            value = getattr(self, name)
            if not (value >= 0 if name == "startup_s" else value > 0) or not math.isfinite(value):
                raise InvalidParameterError(name, f"must be a {'non-negative' if name == 'startup_s' else 'positive'} "
                                                  f"number, got {value!r}")


@dataclass
class ScaleEvent:
    t: float
    replicas: int
    reason: str


@dataclass
class FleetRun:
    """What a simulation produced."""

    results: list[RequestResult]
    rejected: int
    unfinished: int
    duration_s: float  # to the last answer (or the last arrival): goodput's denominator
    settled_s: float  # when the fleet was back at its minimum after the trace (replica-seconds run to here)
    replica_seconds: float
    max_replicas: int
    scale_events: list[ScaleEvent]
    timeline: list[tuple[float, int, int]]  # (t, replicas asked for, open requests) at every tick
    kv_peak: float
    steps: int


_ARRIVE, _STEP, _READY, _TICK = range(4)


class Fleet:
    """One simulation (module docstring); ``run`` plays a trace through it."""

    def __init__(self, profile: StepProfile, config: FleetConfig, seed: int = 0) -> None:
        self.profile = profile
        self.config = config
        self.router = PrefixRouterCore(seed=seed)
        self.replicas: list[SimReplica] = []
        self._names = itertools.count()
        self._events: list[tuple[float, int, int, object]] = []
        self._order = itertools.count()
        self._pending: list[tuple[str, Arrival]] = []
        self._state = PolicyState()
        self._busy = 0  # replicas stepping now
        self._default_since: tuple[int, float] | None = None  # the default policy's (direction, since)
        self.scale_events: list[ScaleEvent] = []

    # ---------------------------------------------------------------- events
    def _push(self, t: float, kind: int, payload: object) -> None:
        heapq.heappush(self._events, (t, next(self._order), kind, payload))

    def _add_replica(self, now: float, ready_at: float) -> None:
        replica = SimReplica(f"r{next(self._names)}", self.profile, started=now, ready_at=ready_at)
        self.replicas.append(replica)
        self._push(ready_at, _READY, replica)

    def _live(self) -> list[SimReplica]:
        """Replicas asked for and not draining (the count the policy steers)."""
        return [r for r in self.replicas if r.stopped is None and not r.draining]

    def _routable(self, now: float) -> list[SimReplica]:
        return [r for r in self._live() if r.ready_at <= now]

    def _dispatch(self, rid: str, arrival: Arrival, now: float) -> None:
        candidates = self._routable(now)
        if not candidates:
            self._pending.append((rid, arrival))
            return
        by_name = {r.name: r for r in candidates}
        replica = by_name[self.router.choose("", {r.name: float(r.open_requests) for r in candidates}, now)]
        replica.add(rid, arrival.prompt_tokens, arrival.output_tokens, now)
        if replica.busy_until is None:
            self._start(replica, now)

    def _start(self, replica: SimReplica, now: float) -> None:
        slowdown = 1.0
        if self.config.host_cores is not None:
            slowdown = max(1.0, (self._busy + 1) / self.config.host_cores)
        end = replica.start_step(now, slowdown)
        if end is not None:
            self._busy += 1
            self._push(end, _STEP, replica)
        elif replica.draining and not replica.tracked:
            replica.stopped = now
            self.router.remove_replica(replica.name)

    # ---------------------------------------------------------------- policy
    def _desired(self, now: float) -> tuple[int, str]:
        live = self._live()
        n = len(live)
        loads = [r.load(now) for r in live if r.ready_at <= now]
        cfg = self.config.autoscaling
        if self.config.policy == "flotilla":
            decision = decide(cfg, n, loads, now, self._state)
            self._state = decision.state
            return decision.desired_replicas, decision.reason
        ongoing = sum(r.open_requests for r in live) + len(self._pending)
        wanted = min(cfg.max_replicas, max(cfg.min_replicas, math.ceil(ongoing / self.config.target_ongoing_requests)))
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
        return wanted, f"{ongoing} ongoing / {self.config.target_ongoing_requests}"

    def _scale(self, now: float) -> None:
        live = self._live()
        target, reason = self._desired(now)
        if target > len(live):
            for _ in range(target - len(live)):
                self._add_replica(now, now + self.config.startup_s)
        elif target < len(live):
            # Drain the emptiest first; one still starting costs nothing to drop.
            for replica in sorted(live, key=lambda r: (r.ready_at <= now, r.open_requests))[: len(live) - target]:
                replica.draining = True
                if not replica.tracked and replica.busy_until is None:
                    replica.stopped = now
                    self.router.remove_replica(replica.name)
        else:
            return
        self.scale_events.append(ScaleEvent(round(now, 3), target, reason))

    # ---------------------------------------------------------------- run
    def run(self, trace: list[Arrival]) -> FleetRun:
        cfg, cap = self.config, self.profile.capacity
        initial = cfg.initial_replicas if cfg.initial_replicas is not None else max(1, cfg.autoscaling.min_replicas)
        for _ in range(initial):
            self._add_replica(0.0, 0.0)
        rejected = 0
        for i, a in enumerate(trace):
            if a.prompt_tokens >= cap.max_model_len or a.prompt_tokens + a.output_tokens > cap.max_model_len:
                rejected += 1  # a real replica answers 400: does not fit max_model_len
                continue
            self._push(a.t, _ARRIVE, (f"q{i}", a))
        self._push(0.0, _TICK, None)
        last = trace[-1].t if trace else 0.0
        served_at: float | None = None  # the first tick with every request of the trace answered
        results: list[RequestResult] = []
        timeline: list[tuple[float, int, int]] = []
        now = 0.0
        arrivals_left = len(trace) - rejected
        steps = 0
        while self._events:
            now, _, kind, payload = heapq.heappop(self._events)
            if kind == _ARRIVE:
                assert isinstance(payload, tuple)
                arrivals_left -= 1
                self._dispatch(payload[0], payload[1], now)
            elif kind == _STEP:
                assert isinstance(payload, SimReplica)
                steps += 1
                self._busy -= 1
                results.extend(payload.finish_step(now))
                self._start(payload, now)
            elif kind == _READY:
                assert isinstance(payload, SimReplica)
                if payload.stopped is None and not payload.draining:
                    pending, self._pending = self._pending, []
                    for rid, arrival in pending:
                        self._dispatch(rid, arrival, now)
            else:
                open_requests = sum(r.open_requests for r in self.replicas) + len(self._pending)
                timeline.append((now, len(self._live()), open_requests))
                if arrivals_left == 0 and open_requests == 0 and served_at is None:
                    served_at = now
                settled = len(self._live()) <= max(1, cfg.autoscaling.min_replicas)
                if arrivals_left == 0 and ((open_requests == 0 and settled) or now > last + MAX_TAIL_S):
                    break  # served and scaled back down (or never will be: the rest count as unfinished)
                self._scale(now)
                if self._pending and not self._live():  # Serve starts a replica for a request queued at zero
                    self._add_replica(now, now + cfg.startup_s)
                    self.scale_events.append(ScaleEvent(round(now, 3), 1, "scale from zero: a request waits"))
                self._push(now + cfg.tick_s, _TICK, None)
        for r in self.replicas:
            if r.stopped is None:
                r.stopped = now
        unfinished = sum(r.open_requests for r in self.replicas) + len(self._pending)
        served = max((r.start_s + (r.e2e_s or 0.0) for r in results), default=0.0)
        return FleetRun(
            results=results, rejected=rejected, unfinished=unfinished, duration_s=max(served, last),
            settled_s=now,
            replica_seconds=sum(r.stopped - r.started for r in self.replicas if r.stopped is not None),
            max_replicas=max((n for _, n, _ in timeline), default=initial),
            scale_events=self.scale_events, timeline=timeline,
            kv_peak=max((r.kv_peak for r in self.replicas), default=0.0), steps=steps)
