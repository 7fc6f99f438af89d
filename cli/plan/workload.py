"""``flotilla plan --workload``: how many GPUs meet a workload's SLOs, colocated or split into prefill and decode
pools, found by simulation (``cli.simulate``) rather than by formula.

The workload is ``prompt_tokens=N,output_tokens=M,rate=R`` (a Poisson trace
of ``minutes`` with those fixed lengths) or a trace (a JSONL path or a
``simulate`` generator). A layout meets the SLOs when its simulation of the
trace, with every pool at a fixed size, answers every request with TTFT P95
and TPOT P95 within the SLOs (``--slo ttft_p95_ms=..,tpot_p95_ms=..``).

- **colocated**: the smallest replica count that meets them (doubling,
  then bisection: more replicas never hurt a fixed-size fleet's P95s);
- **disaggregated**: the smallest prefill pool that meets the TTFT SLO with
  a decode pool as large as the budget allows, then the smallest decode pool
  that meets both beside it (growing the prefill pool again if the pair
  misses TTFT).

A layout too small is not simulated to the end: its run stops once more than
5% of the trace's requests have missed an SLO (``cli.simulate.fleet.GiveUp``),
so the search costs little more than the layouts that are close.

Each layout reports ``gpus`` (replicas x ``tp``), ``prefill_gpus``,
``decode_gpus``, ``goodput_req_per_s``, its P95s and
``cost_per_1m_tokens`` (with ``--price-per-hour``; output tokens), or
``fits: false`` when ``max_gpus`` is not enough. ``recommended`` is the
layout with fewer GPUs (ties: more goodput), and ``why`` says what binds:
the SLO the next smaller colocated fleet misses, and the pools' sizes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cli.plan.planner import cost_per_million_tokens
from cli.simulate.fleet import Disaggregation, Fleet, FleetConfig, GiveUp
from cli.simulate.profile import StepProfile
from cli.simulate.report import report
from cli.simulate.trace import Arrival, load_trace
from cluster.autoscaling_pools import AutoscalingConfig
from scheduling.errors import InvalidParameterError

_WORKLOAD_KEYS = ("prompt_tokens", "output_tokens", "rate")
_SLO_KEYS = ("ttft_p95_ms", "tpot_p95_ms")


def _pairs(text: str, keys: tuple[str, ...], param: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for item in filter(None, text.split(",")):
        key, eq, raw = item.partition("=")
        if not eq or key.strip() not in keys:
            raise InvalidParameterError(param, f"{item!r} is not key=value with a key of {', '.join(keys)}")
        try:
            value = float(raw)
        except ValueError:
            raise InvalidParameterError(param, f"{key}={raw!r} is not a number") from None
        if not (value > 0 and math.isfinite(value)):
            raise InvalidParameterError(param, f"{key} must be a positive number, got {value}")
        out[key.strip()] = value
    missing = [k for k in keys if k not in out]
    if missing:
        raise InvalidParameterError(param, f"missing {', '.join(missing)} (give {', '.join(f'{k}=...' for k in keys)})")
    return out


def workload_trace(workload: str, minutes: float) -> str:
    """A ``simulate --trace`` of the workload: ``prompt_tokens=N,output_tokens=M,rate=R`` becomes a Poisson
    generator of fixed lengths; anything else is a trace already (a JSONL path or a generator)."""
    if "=" in workload and ":" not in workload and not Path(workload).is_file():
        w = _pairs(workload, _WORKLOAD_KEYS, "workload")
        return (f"poisson:rate={w['rate']},minutes={minutes},prompt_tokens={int(w['prompt_tokens'])},"
                f"output_tokens={int(w['output_tokens'])},spread=0")
    return workload


def parse_slo(text: str) -> dict[str, float]:
    """``ttft_p95_ms=..,tpot_p95_ms=..`` -> both, in ms."""
    return _pairs(text, _SLO_KEYS, "slo")


@dataclass(frozen=True, slots=True)
class Outcome:
    """One layout's simulation: its report and whether it met the SLOs."""

    prefill: int
    decode: int
    figures: dict[str, Any]
    meets: bool
    missed: str  # the SLOs it missed ("" when it met them)


class Sizer:
    """Simulations of fixed-size layouts of one trace, each run once (``outcome`` caches them)."""

    def __init__(self, profile: StepProfile, arrivals: list[Arrival], slo: dict[str, float],
                 disaggregation: Disaggregation) -> None:
        self.profile = profile
        self.arrivals = arrivals
        self.slo = slo
        self.disaggregation = disaggregation
        self._seen: dict[tuple[int, int], Outcome] = {}

    @property
    def simulations(self) -> int:
        """Layouts simulated so far."""
        return len(self._seen)

    def outcome(self, prefill: int, decode: int) -> Outcome:
        """The simulation of ``prefill`` prefill replicas (0: colocated) and ``decode`` decode replicas."""
        key = (prefill, decode)
        if key not in self._seen:
            pd = None
            if prefill:
                pd = Disaggregation(prefill=AutoscalingConfig(min_replicas=prefill, max_replicas=prefill,
                                                              pool="prefill"),
                                    kv_transfer_bytes_per_s=self.disaggregation.kv_transfer_bytes_per_s,
                                    remote_prefill_min_tokens=self.disaggregation.remote_prefill_min_tokens,
                                    kv_bytes_per_token=self.disaggregation.kv_bytes_per_token)
            config = FleetConfig(startup_s=0.0, disaggregation=pd, autoscaling=AutoscalingConfig(
                min_replicas=decode, max_replicas=decode, pool="decode" if prefill else None))
            run = Fleet(self.profile, config).run(self.arrivals, GiveUp(self.slo["ttft_p95_ms"] / 1e3,
                                                                        self.slo["tpot_p95_ms"] / 1e3))
            figures = report(run, slo_ms={"ttft": self.slo["ttft_p95_ms"], "tpot": self.slo["tpot_p95_ms"]},
                             wall_s=0.0, profile={}, policy="fixed")
            if run.gave_up is not None:
                missed = run.gave_up.split(", ")
            else:
                missed = [name for name, key in (("ttft", "ttft_p95_ms"), ("tpot", "tpot_p95_ms"))
                          if (figures[key] or 0.0) > self.slo[key]]
                if figures["unfinished"]:
                    missed.append("unfinished requests")
            self._seen[key] = Outcome(prefill, decode, figures, not missed, ", ".join(missed))
        return self._seen[key]

    def smallest(self, meets: Any, limit: int) -> int | None:
        """The smallest n in 1..limit with ``meets(n)``, by doubling then bisection (None: not even ``limit``)."""
        hi = 1
        while not meets(hi):
            if hi >= limit:
                return None
            hi = min(2 * hi, limit)
        lo = hi // 2  # meets(lo) is False (or lo is 0)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if meets(mid):
                hi = mid
            else:
                lo = mid
        return hi


def _layout(o: Outcome | None, tp: int, price: float | None) -> dict[str, Any]:
    if o is None:
        return {"fits": False}
    f = o.figures
    gpus = tp * (o.prefill + o.decode)
    cost = None
    if price is not None and f["output_tok_per_s"]:
        cost = round(cost_per_million_tokens(price, gpus, f["output_tok_per_s"]), 4)
    return {"fits": True, "gpus": gpus, "prefill_gpus": tp * o.prefill, "decode_gpus": tp * o.decode,
            "goodput_req_per_s": f["goodput_req_per_s"], "ttft_p95_ms": f["ttft_p95_ms"],
            "tpot_p95_ms": f["tpot_p95_ms"], "output_tok_per_s": f["output_tok_per_s"], "cost_per_1m_tokens": cost}


def plan_workload(profile: StepProfile, workload: str, slo: dict[str, float], *, max_gpus: int = 64, tp: int = 1,
                  minutes: float = 2.0, price_per_hour: float | None = None,
                  disaggregation: Disaggregation | None = None) -> dict[str, Any]:
    """The sizing (module docstring) as a JSON-ready dict."""
    if max_gpus < tp:
        raise InvalidParameterError("max_gpus", f"{max_gpus} is below one replica's {tp} GPUs")
    trace = workload_trace(workload, minutes)
    arrivals = load_trace(trace)
    pd = disaggregation or Disaggregation(remote_prefill_min_tokens=0)
    sizer = Sizer(profile, arrivals, slo, pd)
    budget = max_gpus // tp  # replicas
    n = sizer.smallest(lambda k: sizer.outcome(0, k).meets, budget)
    colocated = sizer.outcome(0, n) if n is not None else None
    best = None
    if budget >= 2:
        # The prefill pool that keeps TTFT with decode as large as it can be, then the decode pool beside it.
        p = sizer.smallest(lambda k: "ttft" not in sizer.outcome(k, budget - k).missed, budget - 1)
        while p is not None and p < budget:
            d = sizer.smallest(lambda k, p=p: sizer.outcome(p, k).meets, budget - p)
            if d is not None:
                best = sizer.outcome(p, d)
                break
            p += 1  # the decode pool cannot make up for it: a larger prefill pool
    layouts = {"colocated": colocated, "disaggregated": best}
    fitting = {k: v for k, v in layouts.items() if v is not None}
    recommended = min(fitting, key=lambda k: (fitting[k].prefill + fitting[k].decode,
                                              -(fitting[k].figures["goodput_req_per_s"] or 0))) if fitting else None
    why: list[str] = []
    if n is not None and n > 1:
        below = sizer.outcome(0, n - 1)
        why.append(f"colocated: {n - 1} replica(s) miss {below.missed} (TTFT P95 {below.figures['ttft_p95_ms']} ms, "
                   f"TPOT P95 {below.figures['tpot_p95_ms']} ms)")
    if best is not None:
        why.append(f"disaggregated: prefill:decode {best.prefill}:{best.decode} (fewer prefill replicas miss TTFT; "
                   f"fewer decode replicas miss {sizer.outcome(best.prefill, best.decode - 1).missed or 'nothing'})"
                   if best.decode > 1 else f"disaggregated: prefill:decode {best.prefill}:{best.decode}")
    return {
        "workload": trace, "slo": slo, "tp": tp, "max_gpus": max_gpus, "requests": len(arrivals),
        "colocated": _layout(colocated, tp, price_per_hour),
        "disaggregated": _layout(best, tp, price_per_hour),
        "recommended": recommended, "why": why, "simulations": sizer.simulations,
        "profile": profile.to_dict(),
    }
