"""The discrete-event simulation of a fleet: arrivals, routers, replicas' steps, KV hand-offs and autoscalers.

Simulated time only: nothing sleeps, so an hour of traffic takes as long as
its scheduler work. A fleet is one colocated pool, or with
``disaggregation`` a prefill pool and a decode pool (``cli.simulate.pool``).
Events, in time order (ties: in the order queued):

- an **arrival** goes to its pool (colocated; or prefill, unless its prompt
  is shorter than ``remote_prefill_min_tokens``, which the decode pool
  prefills itself, as ``apps.replica.disaggregation`` does) through the real
  router's choice, to a ready replica that is not draining; with none ready
  it waits at the proxy, as Serve's handle queues it;
- a replica's **step end** applies the step (``SimReplica``), starts the
  next one at once if there is work, and ends requests: a prefill replica's
  request has its first token, and its KV reaches the decode pool
  ``prompt x kv_bytes_per_token / kv_transfer_bytes_per_s`` seconds later
  (a **hand-off**), where it decodes the rest without recomputing its
  prompt (the scheduler's KV import path); TTFT is when the decode replica
  has it, as a client of the real app sees the first token then;
- a **tick** (every ``tick_s``) asks each pool's policy for its replica
  count: ``flotilla`` is ``cluster.autoscaling.decide`` on the pool's own
  signals; ``default`` is Ray Serve's ongoing-requests rule
  (``ceil(ongoing / target_ongoing_requests)``, held for Serve's 30 s up /
  600 s down delays). New replicas are ready ``startup_s`` later; a replica
  scaled away drains (no new requests) and stops when it has none.

Replica-seconds count from when a replica is asked for until it stops. The
run goes on after the last answer until every pool has scaled back to its
minimum (the idle replicas of a slow scale-down are a real cost), bounded by
``MAX_TAIL_S`` past the last arrival; requests still open then are
unfinished.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field

from cli.bench.stream_client import RequestResult
from cli.simulate.pool import Policy, Pool, ScaleEvent, Work
from cli.simulate.profile import RooflineProfile, StepProfile
from cli.simulate.replica import SimReplica
from cli.simulate.trace import Arrival
from cluster.autoscaling_pools import AutoscalingConfig
from scheduling.errors import InvalidParameterError

MAX_TAIL_S = 3600.0  # simulated time past the last arrival after which requests still open are unfinished


@dataclass(frozen=True)
class Disaggregation:
    """A prefill pool beside the decode pool, and how prompts' KV moves between them.

    ``kv_bytes_per_token``: None takes the roofline profile's (a measured
    profile has none: give it).
    """

    prefill: AutoscalingConfig = field(default_factory=lambda: AutoscalingConfig(pool="prefill"))
    kv_transfer_bytes_per_s: float = 25e9  # one NIC-class link per hand-off (RDMA / NVLink go higher)
    remote_prefill_min_tokens: int = 512  # shorter prompts are prefilled on the decode replica
    kv_bytes_per_token: int | None = None

    def __post_init__(self) -> None:
        if self.prefill.pool != "prefill":
            raise InvalidParameterError("disaggregation", "the prefill pool's autoscaling must have pool: prefill")
        rate = self.kv_transfer_bytes_per_s
        if isinstance(rate, bool) or not isinstance(rate, int | float) or not (rate > 0 and math.isfinite(rate)):
            raise InvalidParameterError("kv_transfer_bytes_per_s", f"must be positive, got {self.kv_transfer_bytes_per_s}")
        if not isinstance(self.remote_prefill_min_tokens, int) or self.remote_prefill_min_tokens < 0:
            raise InvalidParameterError("remote_prefill_min_tokens", "must be >= 0")


@dataclass(frozen=True)
class FleetConfig:
    """How the fleet runs: the policy and its settings, start-up time, control-loop period, the pools.

    ``autoscaling`` steers the colocated pool, or with ``disaggregation`` the
    decode pool (give it ``pool: decode`` for the decode signals).
    """

    policy: Policy = "flotilla"
    autoscaling: AutoscalingConfig = field(default_factory=AutoscalingConfig)
    target_ongoing_requests: float = 2.0  # the default policy's target per replica
    startup_s: float = 30.0  # from the scale-up decision to a replica taking requests
    tick_s: float = 1.0
    initial_replicas: int | None = None  # per pool; None: its min_replicas (at least 1)
    # Replicas sharing one host's CPU cores (a CPU machine): a step that starts while b replicas are stepping,
    # s are starting and w requests wait in replicas' queues takes max(1, (b + s + 1 + c x w) / host_cores)
    # times the profile's time (a starting replica builds its actors and model on the same cores; c is the
    # profile's host_share_per_waiting). None: the profile's measured figure (``bench profile
    # --served --host-replicas``), else each replica has its own device.
    host_cores: float | None = None
    disaggregation: Disaggregation | None = None

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


@dataclass(frozen=True)
class GiveUp:
    """End a run early once more than ``fraction`` of the trace's requests are known to miss an SLO: their
    P95 cannot meet it any more (a planner's search needs no more of a layout that is too small)."""

    ttft_s: float
    tpot_s: float
    fraction: float = 0.05


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
    handoffs: int = 0
    gave_up: str | None = None  # the SLO a ``GiveUp`` run was ended for


_ARRIVE, _STEP, _READY, _TICK, _HANDOFF = range(5)


class Fleet:
    """One simulation (module docstring); ``run`` plays a trace through it."""

    def __init__(self, profile: StepProfile, config: FleetConfig, seed: int = 0) -> None:
        self.profile = profile
        self._host_cores = config.host_cores if config.host_cores is not None else profile.host_cores
        self.config = config
        pd = config.disaggregation
        main = Pool("decode" if pd else "r", profile, config.autoscaling, config.policy,
                    config.target_ongoing_requests, seed=seed)
        self.pools: list[Pool] = [main]
        self.prefill: Pool | None = None
        self.kv_bytes_per_token = 0
        if pd is not None:
            self.prefill = Pool("prefill", profile, pd.prefill, config.policy, config.target_ongoing_requests,
                                seed=seed + 1)
            self.pools.insert(0, self.prefill)
            per_token = pd.kv_bytes_per_token
            if per_token is None:
                if not isinstance(profile, RooflineProfile):
                    raise InvalidParameterError("kv_bytes_per_token", "a measured profile does not know the KV "
                                                                      "bytes per token: give disaggregation's")
                per_token = profile.kv_bytes_per_token
            self.kv_bytes_per_token = per_token
        self.main = main
        self._events: list[tuple[float, int, int, object]] = []
        self._order = itertools.count()
        self._busy = 0  # replicas stepping now
        self._pool_of: dict[str, Pool] = {}
        self._output_tokens: dict[str, int] = {}  # requests prefilled remotely: what the decode pool generates

    @property
    def replicas(self) -> list[SimReplica]:
        return [r for pool in self.pools for r in pool.replicas]

    # ---------------------------------------------------------------- events
    def _push(self, t: float, kind: int, payload: object) -> None:
        heapq.heappush(self._events, (t, next(self._order), kind, payload))

    def _added(self, pool: Pool, replicas: list[SimReplica]) -> None:
        for replica in replicas:
            self._pool_of[replica.name] = pool
            self._push(replica.ready_at, _READY, replica)

    def _place(self, pool: Pool, work: Work, now: float) -> None:
        replica = pool.place(work, now)
        if replica is not None and replica.busy_until is None:
            self._start(replica, now)

    def _arrive(self, rid: str, a: Arrival, now: float) -> None:
        pd = self.config.disaggregation
        if self.prefill is not None and pd is not None and a.prompt_tokens >= pd.remote_prefill_min_tokens:
            self._output_tokens[rid] = a.output_tokens
            self._place(self.prefill, Work(rid, now, a.prompt_tokens, 1), now)  # prefill and first token only
        else:
            self._place(self.main, Work(rid, now, a.prompt_tokens, a.output_tokens), now)

    def _start(self, replica: SimReplica, now: float) -> None:
        end = replica.start_step(now, None if self._host_cores is None else lambda: self._host_slowdown(now))
        if end is not None:
            self._busy += 1
            self._push(end, _STEP, replica)
        else:
            self._pool_of[replica.name].stop_if_drained(replica, now)

    def _host_slowdown(self, now: float) -> float:
        """A step starting now on a shared host (``FleetConfig.host_cores``); a CPU host has few replicas,
        so counting them per step is cheap."""
        assert self._host_cores is not None
        load = self._busy + 1.0
        for r in self.replicas:
            if r.stopped is None:
                load += (r.ready_at > now) + self.profile.host_share_per_waiting * len(r.policy.waiting)
        return max(1.0, load / self._host_cores)

    # ---------------------------------------------------------------- run
    def run(self, trace: list[Arrival], give_up: GiveUp | None = None) -> FleetRun:
        cfg, cap = self.config, self.profile.capacity
        for pool in self.pools:
            n = cfg.initial_replicas if cfg.initial_replicas is not None else max(1, pool.autoscaling.min_replicas)
            self._added(pool, [pool.add_replica(0.0, 0.0) for _ in range(n)])
        rejected = 0
        for i, a in enumerate(trace):
            if a.prompt_tokens >= cap.max_model_len or a.prompt_tokens + a.output_tokens > cap.max_model_len:
                rejected += 1  # a real replica answers 400: does not fit max_model_len
                continue
            self._push(a.t, _ARRIVE, (f"q{i}", a))
        self._push(0.0, _TICK, None)
        last = trace[-1].t if trace else 0.0
        results: list[RequestResult] = []
        timeline: list[tuple[float, int, int]] = []
        now = 0.0
        arrivals_left = len(trace) - rejected
        steps = handoffs = 0
        gave_up: str | None = None
        late = {"ttft": 0, "tpot": 0}
        limit = give_up.fraction * len(trace) if give_up is not None else math.inf
        while self._events:
            now, _, kind, payload = heapq.heappop(self._events)
            if kind == _ARRIVE:
                assert isinstance(payload, tuple)
                arrivals_left -= 1
                self._arrive(payload[0], payload[1], now)
            elif kind == _STEP:
                assert isinstance(payload, SimReplica)
                steps += 1
                self._busy -= 1
                pool = self._pool_of[payload.name]
                done = payload.finish_step(now)
                if pool is self.prefill:
                    for rid, r in done:  # the first token is out: the KV goes to the decode pool
                        transfer = r.prompt_tokens * self.kv_bytes_per_token / self._transfer_rate()
                        self._push(now + transfer, _HANDOFF, (rid, r))
                else:
                    results.extend(r for _, r in done)
                    if give_up is not None:
                        for _, r in done:
                            late["ttft"] += (r.ttft_s or 0.0) > give_up.ttft_s
                            late["tpot"] += (r.tpot_s or 0.0) > give_up.tpot_s
                        missed = [name for name, n in late.items() if n > limit]
                        if missed:
                            gave_up = ", ".join(missed)
                            break
                self._start(payload, now)
            elif kind == _HANDOFF:
                assert isinstance(payload, tuple)
                rid, prefilled = payload
                handoffs += 1
                self._place(self.main, Work(rid, prefilled.start_s, prefilled.prompt_tokens,
                                            self._output_tokens.pop(rid), first_token_at=now), now)
            elif kind == _READY:
                assert isinstance(payload, SimReplica)
                pool = self._pool_of[payload.name]
                if payload.stopped is None and not payload.draining:
                    pending, pool.pending = pool.pending, []
                    for work in pending:
                        self._place(pool, work, now)
            else:
                open_requests = sum(p.open_requests for p in self.pools) + len(self._output_tokens)
                timeline.append((now, sum(len(p.live()) for p in self.pools), open_requests))
                settled = all(len(p.live()) <= max(1, p.autoscaling.min_replicas) for p in self.pools)
                if arrivals_left == 0 and ((open_requests == 0 and settled) or now > last + MAX_TAIL_S):
                    break  # served and scaled back down (or never will be: the rest count as unfinished)
                for pool in self.pools:
                    self._added(pool, pool.scale(now, cfg.startup_s))
                self._push(now + cfg.tick_s, _TICK, None)
        for replica in self.replicas:
            if replica.stopped is None:
                replica.stopped = now
        served = max((r.start_s + (r.e2e_s or 0.0) for r in results), default=0.0)
        return FleetRun(
            results=results, rejected=rejected, gave_up=gave_up,
            unfinished=len(trace) - rejected - len(results),  # still open, or (given up) not yet arrived
            duration_s=max(served, last), settled_s=now,
            replica_seconds=sum(r.stopped - r.started for r in self.replicas if r.stopped is not None),
            max_replicas=max((n for _, n, _ in timeline), default=len(self.replicas)),
            scale_events=sorted((e for p in self.pools for e in p.events), key=lambda e: e.t), timeline=timeline,
            kv_peak=max((r.kv_peak for r in self.replicas), default=0.0), steps=steps, handoffs=handoffs)

    def _transfer_rate(self) -> float:
        assert self.config.disaggregation is not None
        return self.config.disaggregation.kv_transfer_bytes_per_s
