"""The interference workload of ``flotilla bench pd``: steady decode streams plus periodic long prompts.

``streams`` closed-loop clients each send a short prompt (``short_tokens``
random token ids) with ``max_tokens`` drawn from ``output_tokens``, wait for
its stream to end, and send the next, until ``duration_s``; meanwhile a long
prompt (``long_tokens`` ids, ``long_max_tokens`` output tokens) leaves at
``long_every_s * (k + 1/2)`` for every such time before ``duration_s``, on
its own (it does not wait for the previous one). Every request streams with
``ignore_eos`` and greedy sampling through the benchmarks' one client
(``cli.bench.stream_client``: TTFT, TPOT, tokens from usage).

Requests are a function of ``(seed, stream, index)``: the same seed sends the
same prompts in the same order in every mode, whichever server answers
faster. Token ids are random, so no prompt finds another's prefix cached.
"""

from __future__ import annotations

import asyncio
import math
import random
from dataclasses import dataclass, field, replace

import aiohttp

from cli.bench.stream_client import RequestResult, stream_request
from cli.bench.workload import BenchRequest
from scheduling.errors import InvalidParameterError

# A stream stops at the deadline; this bounds it too when every request fails at once.
MAX_REQUESTS_PER_STREAM = 100_000


@dataclass(frozen=True, slots=True)
class PDWorkload:
    """What the two runs send (identical in both modes); validated when built."""

    streams: int = 4
    short_tokens: int = 32
    output_tokens: tuple[int, int] = (64, 128)  # inclusive range of a stream request's max_tokens
    long_tokens: int = 2048
    long_max_tokens: int = 8
    long_every_s: float = 10.0
    duration_s: float = 60.0
    vocab: int = 256  # token ids are drawn from [0, vocab)
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("streams", "short_tokens", "long_tokens", "long_max_tokens", "vocab"):
            if getattr(self, name) < 1:
                raise InvalidParameterError(name, f"must be >= 1, got {getattr(self, name)}")
        lo, hi = self.output_tokens
        if not 2 <= lo <= hi:  # TPOT needs two tokens
            raise InvalidParameterError("output_tokens", f"need 2 <= min <= max, got {lo}..{hi}")
        if not self.long_every_s > 0:
            raise InvalidParameterError("long_every_s", f"must be > 0, got {self.long_every_s}")
        if not self.duration_s > 0:
            raise InvalidParameterError("duration_s", f"must be > 0, got {self.duration_s}")
        if self.short_tokens >= self.long_tokens:
            raise InvalidParameterError("long_tokens", f"must exceed short_tokens ({self.short_tokens}), "
                                                       f"got {self.long_tokens}")

    def short_request(self, stream: int, index: int) -> BenchRequest:
        """Request ``index`` of decode stream ``stream``."""
        rng = random.Random(f"pd/{self.seed}/short/{stream}/{index}")
        ids = [rng.randrange(self.vocab) for _ in range(self.short_tokens)]
        return BenchRequest(rng.randint(*self.output_tokens), prompt=ids, num_prompt_tokens=len(ids))

    def long_request(self, index: int) -> BenchRequest:
        """Long prompt ``index``."""
        rng = random.Random(f"pd/{self.seed}/long/{index}")
        ids = [rng.randrange(self.vocab) for _ in range(self.long_tokens)]
        return BenchRequest(self.long_max_tokens, prompt=ids, num_prompt_tokens=len(ids))

    def warmup_requests(self) -> list[BenchRequest]:
        """One short and one long request, sent untimed first (first-call costs, the remote path's too).

        Their own seed keeps them out of the timed prompts' prefix cache.
        """
        warm = replace(self, seed=-1 - self.seed)
        return [warm.short_request(0, 0), warm.long_request(0)]

    def long_offsets(self) -> list[float]:
        """Send times of the long prompts, in seconds from the run's start."""
        count = max(0, math.ceil(self.duration_s / self.long_every_s - 0.5))  # (k + 1/2) periods < duration_s
        return [self.long_every_s * (k + 0.5) for k in range(count)]


@dataclass(slots=True)
class WorkloadResult:
    """What one run's clients saw: the decode streams' requests and the long prompts'."""

    short: list[RequestResult] = field(default_factory=list)
    long: list[RequestResult] = field(default_factory=list)
    duration_s: float = 0.0  # from the start until the last request ended


async def send(session: aiohttp.ClientSession, base_url: str, model: str, req: BenchRequest) -> RequestResult:
    """One streaming request of the workload, greedy and ignore_eos (never raises for server or network errors)."""
    return await stream_request(session, base_url + req.endpoint, req.body(model, temperature=0.0, ignore_eos=True))


async def run_workload(session: aiohttp.ClientSession, base_url: str, model: str, plan: PDWorkload) -> WorkloadResult:
    """Run ``plan`` against ``base_url``; returns when every request it sent has ended."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    deadline = start + plan.duration_s
    out = WorkloadResult()

    async def stream(s: int) -> None:
        for i in range(MAX_REQUESTS_PER_STREAM):
            if loop.time() >= deadline:
                return
            sent = loop.time() - start
            result = await send(session, base_url, model, plan.short_request(s, i))
            result.start_s = sent
            out.short.append(result)

    async def long_prompt(k: int, offset: float) -> None:
        delay = start + offset - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)  # the schedule itself, not a synchronisation
        sent = loop.time() - start
        result = await send(session, base_url, model, plan.long_request(k))
        result.start_s = sent
        out.long.append(result)

    await asyncio.gather(*(stream(s) for s in range(plan.streams)),
                         *(long_prompt(k, t) for k, t in enumerate(plan.long_offsets())))
    out.duration_s = loop.time() - start
    return out
