"""``flotilla bench autoscale``: a load profile against a running app, sampled every second.

The profile is a list of phases (idle, ramp, plateau, burst, idle by default),
each a duration and a request rate that moves linearly from ``start_rps`` to
``end_rps``. Arrivals are open-loop and deterministic: request ``k`` is sent
when the integral of the rate reaches ``k``, so two runs offer the same load.
Every request streams (``/v1/completions``), so time to first token (TTFT)
and time per output token (TPOT) are measured at the client, by the
benchmarks' one client (``cli.bench.stream_client``: tokens from usage).

Per second the sampler records: replicas (from a callback; None when unknown),
requests in flight and queued (sent, first token not yet seen), the TTFT/TPOT
P95 of requests that finished in that second, and how many of them were good
(succeeded within both SLOs). The summary: peak and final replicas, failed
requests, goodput (good requests per second of run), replica-seconds, the
first SLO breach and how long the fleet took to reach 3 replicas after it.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp

from actors.api import percentile
from cli.bench.stream_client import stream_request, tpot_s


@dataclass(frozen=True, slots=True)
class Phase:
    """``duration_s`` seconds of load whose rate goes linearly from ``start_rps`` to ``end_rps``."""

    name: str
    duration_s: float
    start_rps: float
    end_rps: float


def default_profile(peak_rps: float, *, idle_s: float = 5, ramp_s: float = 20, plateau_s: float = 30,
                    burst_s: float = 10, cooldown_s: float = 60, burst_factor: float = 2.0) -> list[Phase]:
    """Idle, ramp to ``peak_rps``, plateau, burst at ``burst_factor`` x peak, idle (cool-down)."""
    return [Phase("idle", idle_s, 0, 0), Phase("ramp", ramp_s, 0, peak_rps),
            Phase("plateau", plateau_s, peak_rps, peak_rps),
            Phase("burst", burst_s, peak_rps * burst_factor, peak_rps * burst_factor),
            Phase("idle", cooldown_s, 0, 0)]


def arrival_times(profile: list[Phase]) -> list[float]:
    """Send times (s from start): request k leaves when the rate's integral reaches k + 0.5."""
    times: list[float] = []
    t0, area, k = 0.0, 0.0, 0
    for ph in profile:
        slope = (ph.end_rps - ph.start_rps) / ph.duration_s if ph.duration_s > 0 else 0.0
        steps = max(1, int(ph.duration_s * 100))
        dt = ph.duration_s / steps
        for i in range(steps):  # integrate in 10 ms slices: exact enough, simple
            t = i * dt
            area += (ph.start_rps + slope * (t + dt / 2)) * dt
            while area >= k + 0.5:
                times.append(t0 + t + dt)
                k += 1
        t0 += ph.duration_s
    return times


@dataclass(slots=True)
class RequestRecord:
    """One request as the client saw it (times in s from the run's start)."""

    sent: float
    first_token: float | None = None
    done: float | None = None
    num_tokens: int = 0
    ok: bool = False
    error: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0

    @property
    def ttft_ms(self) -> float | None:
        return None if self.first_token is None else (self.first_token - self.sent) * 1000

    @property
    def tpot_ms(self) -> float | None:
        ttft = None if self.first_token is None else self.first_token - self.sent
        e2e = None if self.done is None else self.done - self.sent
        tpot = tpot_s(ttft, e2e, self.num_tokens)
        return None if tpot is None else tpot * 1000

    def good(self, slo_ttft_ms: float, slo_tpot_ms: float) -> bool:
        ttft, tpot = self.ttft_ms, self.tpot_ms
        return self.ok and ttft is not None and ttft <= slo_ttft_ms and (tpot is None or tpot <= slo_tpot_ms)


async def stream_completion(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
                            rec: RequestRecord, start: float, headers: dict[str, str] | None = None) -> None:
    """POST a streaming completion and fill ``rec`` (never raises: failures are recorded).

    Through the benchmarks' one client (``stream_request``): tokens from usage, never chunks.
    """
    def first_output() -> None:
        rec.first_token = time.monotonic() - start

    result = await stream_request(session, f"{url}/v1/completions", body, headers=headers,
                                  on_first_output=first_output)
    rec.done = rec.sent + result.e2e_s if result.e2e_s is not None else None
    if result.ttft_s is not None:
        rec.first_token = rec.sent + result.ttft_s  # the client's own clock, as E2E
    rec.num_tokens, rec.prompt_tokens, rec.cached_tokens = (result.output_tokens, result.prompt_tokens,
                                                            result.cached_tokens)
    rec.ok, rec.error = result.ok, result.error


def make_prompt(rng: random.Random, num_chars: int) -> str:
    words = ("ship", "sail", "harbor", "wind", "tide", "mast", "crew", "anchor", "deck", "wave")
    out: list[str] = []
    while sum(len(w) + 1 for w in out) < num_chars:
        out.append(rng.choice(words))
    return " ".join(out)[:num_chars]


@dataclass(slots=True)
class Sample:
    """One second of the run."""

    t: float
    offered_rps: float
    replicas: int | None
    replicas_changing: int | None
    in_flight: int
    queued: int
    ttft_p95_ms: float | None
    tpot_p95_ms: float | None
    good: int
    finished: int


@dataclass(slots=True)
class RunResult:
    samples: list[Sample] = field(default_factory=list)
    records: list[RequestRecord] = field(default_factory=list)


def _rate_at(profile: list[Phase], t: float) -> float:
    t0 = 0.0
    for ph in profile:
        if t < t0 + ph.duration_s:
            frac = (t - t0) / ph.duration_s if ph.duration_s > 0 else 0.0
            return ph.start_rps + (ph.end_rps - ph.start_rps) * frac
        t0 += ph.duration_s
    return 0.0


async def run_profile(url: str, profile: list[Phase], *, replica_count: Callable[[], tuple[int, int] | None],
                      slo_ttft_ms: float, slo_tpot_ms: float, prompt_chars: int = 64,
                      max_tokens: int = 32, model: str = "tiny", seed: int = 0,
                      settle: Callable[[tuple[int, int] | None], bool] | None = None,
                      max_settle_s: float = 0.0) -> RunResult:
    """Drive ``profile`` against ``url``; after it, keep sampling up to ``max_settle_s`` more
    seconds until ``settle(replica_count())`` is true (e.g. back at the minimum).

    ``replica_count`` returns ``(running, changing)`` replicas (starting or stopping), or None.
    """
    rng = random.Random(seed)
    result = RunResult()
    start = time.monotonic()
    total_s = sum(ph.duration_s for ph in profile)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks: list[asyncio.Task[None]] = []

        async def sender() -> None:
            for when in arrival_times(profile):
                delay = start + when - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)  # pacing open-loop arrivals, not synchronisation
                rec = RequestRecord(sent=time.monotonic() - start)
                result.records.append(rec)
                body = {"model": model, "prompt": make_prompt(rng, prompt_chars), "max_tokens": max_tokens,
                        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
                tasks.append(asyncio.create_task(stream_completion(session, url, body, rec, start)))

        send_task = asyncio.create_task(sender())
        second = 0
        loop = asyncio.get_running_loop()
        while True:
            second += 1
            delay = start + second - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)  # the sampling clock
            replicas = await loop.run_in_executor(None, replica_count)
            result.samples.append(_sample(result.records, float(second), _rate_at(profile, second - 0.5),
                                          replicas, slo_ttft_ms, slo_tpot_ms))
            past = second - total_s
            drained = past >= 0 and send_task.done() and all(t.done() for t in tasks)
            if drained and (settle is None or settle(replicas) or past >= max_settle_s):
                break
        await send_task
        await asyncio.gather(*tasks)
    return result


def _sample(records: list[RequestRecord], t: float, rate: float, replicas: tuple[int, int] | None,
            slo_ttft_ms: float, slo_tpot_ms: float) -> Sample:
    ended = [r for r in records if r.done is not None and t - 1 <= r.done < t]
    ended += [r for r in records if r.done is None and r.error is not None and t - 1 <= r.sent < t]
    ttfts = [r.ttft_ms for r in ended if r.ttft_ms is not None]
    tpots = [r.tpot_ms for r in ended if r.tpot_ms is not None]
    return Sample(
        t=t, offered_rps=round(rate, 3), replicas=replicas[0] if replicas else None,
        replicas_changing=replicas[1] if replicas else None,
        in_flight=sum(1 for r in records if r.done is None and r.error is None),
        queued=sum(1 for r in records if r.first_token is None and r.done is None and r.error is None),
        ttft_p95_ms=round(percentile(ttfts, 95), 1) if ttfts else None,
        tpot_p95_ms=round(percentile(tpots, 95), 2) if tpots else None,
        good=sum(1 for r in ended if r.good(slo_ttft_ms, slo_tpot_ms)), finished=len(ended),
    )


def summarize(result: RunResult, *, slo_ttft_ms: float, slo_tpot_ms: float, min_replicas: int,
              load_end_s: float) -> dict[str, Any]:
    """The JSON summary of a run (see the module docstring)."""
    recs, samples = result.records, result.samples
    duration = samples[-1].t if samples else 0.0
    known = [s for s in samples if s.replicas is not None]
    failed = [r for r in recs if not r.ok]
    good = [r for r in recs if r.good(slo_ttft_ms, slo_tpot_ms)]
    # The first breach: the first moment a request had waited longer than the TTFT SLO.
    late = [r.sent + slo_ttft_ms / 1000 for r in recs if r.ok and (r.ttft_ms or 0) > slo_ttft_ms]
    late += [r.first_token + slo_tpot_ms / 1000 * (r.num_tokens - 1) for r in recs
             if r.first_token is not None and (r.tpot_ms or 0) > slo_tpot_ms]
    breach = min(late) if late else None
    reach3 = next((s.t for s in known if (s.replicas or 0) >= 3 and (breach is None or s.t >= breach)), None)
    # Back at the minimum: the first sample after the load (and after the last one above the
    # minimum or with replicas still starting/stopping) that shows exactly the minimum.
    busy = [s.t for s in known if (s.replicas or 0) > min_replicas or (s.replicas_changing or 0) > 0]
    after = max([load_end_s, *busy])
    back = next((s.t for s in known if s.t >= after and s.replicas == min_replicas
                 and not s.replicas_changing), None)
    ttfts = [r.ttft_ms for r in recs if r.ttft_ms is not None]
    tpots = [r.tpot_ms for r in recs if r.tpot_ms is not None]
    return {
        "duration_s": duration,
        "num_requests": len(recs),
        "failed_requests": len(failed),
        "first_errors": sorted({r.error or "" for r in failed})[:3],
        "good_requests": len(good),
        "goodput_rps": round(len(good) / duration, 3) if duration else 0.0,
        "replica_seconds": sum(s.replicas or 0 for s in known),
        # Also those starting or stopping: what the fleet holds, as `flotilla simulate` counts it.
        "held_replica_seconds": sum((s.replicas or 0) + (s.replicas_changing or 0) for s in known),
        "peak_replicas": max((s.replicas or 0 for s in known), default=None),
        "final_replicas": known[-1].replicas if known else None,
        "first_breach_s": round(breach, 2) if breach is not None else None,
        "replicas_ge_3_at_s": reach3,
        "scale_up_s_after_breach": round(reach3 - breach, 2) if reach3 is not None and breach is not None else None,
        "back_to_min_at_s": back,
        "scale_down_s_after_load": round(back - load_end_s, 2) if back is not None else None,
        "ttft_ms_p50": round(percentile(ttfts, 50), 1), "ttft_ms_p95": round(percentile(ttfts, 95), 1),
        "tpot_ms_p50": round(percentile(tpots, 50), 2), "tpot_ms_p95": round(percentile(tpots, 95), 2),
    }


def samples_json(result: RunResult) -> list[dict[str, Any]]:
    return [asdict(s) for s in result.samples]
