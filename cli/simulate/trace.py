"""Arrivals for ``flotilla simulate`` and ``flotilla plan --workload``: generated from a spec, or read from JSONL.

A spec is ``kind:key=value,...``:

- ``poisson:rate=R,minutes=M``: arrivals at a constant rate R (req/s);
- ``bursty:rate=R,minutes=M,burst=B,period_s=P``: rate R, times B for the
  first tenth of every P seconds (the mean rises accordingly);
- ``diurnal:peak=R,minutes=M``: a day squeezed into M minutes, the rate
  following ``R (0.1 + 0.9 sin^2(pi t / T))``: 10% of peak at both ends,
  the peak in the middle.

Every kind takes ``prompt_tokens`` (default 512) and ``output_tokens``
(default 128), each the mean of a log-normal length (``spread``, its sigma,
default 0.5; 0: every request the same), and ``seed`` (default 0).
Arrivals of a varying rate are drawn by thinning a Poisson process at the
peak rate, so each generated trace is exact for its rate function.

A JSONL file has one arrival a line: ``{"t": seconds, "prompt_tokens": n,
"output_tokens": m}``, in any order (sorted when read).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from scheduling.errors import InvalidParameterError

KINDS = ("poisson", "bursty", "diurnal")
_COMMON = {"minutes": 10.0, "prompt_tokens": 512.0, "output_tokens": 128.0, "spread": 0.5, "seed": 0.0}
_KEYS: dict[str, dict[str, float]] = {
    "poisson": {"rate": 1.0, **_COMMON},
    "bursty": {"rate": 1.0, "burst": 4.0, "period_s": 60.0, **_COMMON},
    "diurnal": {"peak": 1.0, **_COMMON},
}


@dataclass(frozen=True, slots=True)
class Arrival:
    """One request: when it arrives (seconds from the trace's start) and its lengths in tokens."""

    t: float
    prompt_tokens: int
    output_tokens: int


def parse_spec(spec: str) -> tuple[str, dict[str, float]]:
    """``kind:key=value,...`` -> (kind, every key with its default filled in); refusals name the bad part."""
    kind, _, rest = spec.partition(":")
    if kind not in _KEYS:
        raise InvalidParameterError("trace", f"{spec!r}: not a JSONL file, and {kind!r} is not a generator "
                                             f"({', '.join(KINDS)})")
    values = dict(_KEYS[kind])
    for item in filter(None, rest.split(",")):
        key, eq, raw = item.partition("=")
        if not eq or key not in values:
            raise InvalidParameterError("trace", f"{kind}: {item!r} is not key=value with a key of "
                                                 f"{', '.join(values)}")
        try:
            values[key] = float(raw)
        except ValueError:
            raise InvalidParameterError("trace", f"{kind}: {key}={raw!r} is not a number") from None
    for key, value in values.items():
        if not math.isfinite(value) or value < 0 or (value == 0 and key not in ("spread", "seed")):
            raise InvalidParameterError("trace", f"{kind}: {key} must be a positive number, got {value}")
    return kind, values


def rate_function(kind: str, v: dict[str, float]) -> tuple[Callable[[float], float], float]:
    """The rate (req/s) at time t, and its maximum (the thinning envelope)."""
    duration = v["minutes"] * 60
    if kind == "poisson":
        return (lambda t: v["rate"]), v["rate"]
    if kind == "bursty":
        period, high = v["period_s"], v["rate"] * v["burst"]
        return (lambda t: high if (t % period) < period / 10 else v["rate"]), max(high, v["rate"])
    return (lambda t: v["peak"] * (0.1 + 0.9 * math.sin(math.pi * t / duration) ** 2)), v["peak"]


def _length(rng: random.Random, mean: float, spread: float) -> int:
    """A log-normal length with mean ``mean`` (sigma ``spread``), at least 1 token."""
    if spread == 0:
        return max(1, round(mean))
    mu = math.log(mean) - spread**2 / 2
    return max(1, round(rng.lognormvariate(mu, spread)))


def generate(spec: str) -> list[Arrival]:
    """The arrivals of a generator spec (module docstring), in time order."""
    kind, v = parse_spec(spec)
    rate, peak = rate_function(kind, v)
    rng = random.Random(int(v["seed"]))
    duration = v["minutes"] * 60
    out: list[Arrival] = []
    t = 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= duration:
            return out
        if rng.random() * peak <= rate(t):  # thinning: keep with probability rate(t) / peak
            out.append(Arrival(t, _length(rng, v["prompt_tokens"], v["spread"]),
                               _length(rng, v["output_tokens"], v["spread"])))


def read_jsonl(path: Path) -> list[Arrival]:
    """Arrivals from a JSONL file (module docstring), sorted by time; a bad line is refused with its number."""
    out: list[Arrival] = []
    with path.open() as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                arrival = Arrival(float(row["t"]), int(row["prompt_tokens"]), int(row["output_tokens"]))
            except (ValueError, KeyError, TypeError) as exc:
                raise InvalidParameterError("trace", f"{path}:{number}: not {{\"t\", \"prompt_tokens\", "
                                                     f"\"output_tokens\"}} ({exc})") from None
            if arrival.t < 0 or arrival.prompt_tokens < 1 or arrival.output_tokens < 1:
                raise InvalidParameterError("trace", f"{path}:{number}: t must be >= 0 and lengths >= 1")
            out.append(arrival)
    if not out:
        raise InvalidParameterError("trace", f"{path} holds no arrival")
    return sorted(out, key=lambda a: a.t)


def write_jsonl(arrivals: list[Arrival], path: Path) -> Path:
    """The JSONL form ``read_jsonl`` reads (``flotilla bench autoscale --trace-out`` writes its requests so)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for a in arrivals:
            f.write(json.dumps({"t": round(a.t, 6), "prompt_tokens": a.prompt_tokens,
                                "output_tokens": a.output_tokens}) + "\n")
    return path


def load_trace(trace: str) -> list[Arrival]:
    """A JSONL path, or a generator spec."""
    path = Path(trace)
    return read_jsonl(path) if path.suffix == ".jsonl" or path.is_file() else generate(trace)
