"""``flotilla bench autoscale --mode routing``: prefix-cache reuse and TTFT under a router.

Workload ``prefix``: ``groups`` prompt groups, each a shared prefix of
``prefix_chars`` characters (the tiny model's byte-level tokenizer makes one
token per character) plus a short unique question, ``per_group`` requests per
group, interleaved (g0, g1, ..., g0, g1, ...), sent open-loop at a fixed
rate (a closed loop lets the default router stick by accident: the replica that
just answered is the least loaded, and the next request in the interleaved
order belongs to a fixed other group). Every request names its shared prefix in ``X-Flotilla-Prefix`` (see
``cluster.request_router``): the default router ignores the header, so both
routers get identical traffic. Workload ``unique``: the same shape with no
shared prefix and no header, closed loop with ``concurrency`` in flight, for
throughput.

Prefix-cache hit rate = cached prompt tokens / prompt tokens, summed over
requests from each stream's usage chunk.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import aiohttp

from actors.api import percentile
from cli.bench.autoscale.profile import RequestRecord, make_prompt, stream_completion

PREFIX_HEADER = "X-Flotilla-Prefix"
# A header names the prefix, not the whole text: this many characters is plenty.
HEADER_CHARS = 256


def build_workload(kind: str, *, groups: int, per_group: int, prefix_chars: int, suffix_chars: int,
                   seed: int = 0) -> list[tuple[str, str | None]]:
    """``(prompt, prefix header or None)`` in send order."""
    rng = random.Random(seed)
    if kind == "unique":
        return [(make_prompt(rng, prefix_chars + suffix_chars), None) for _ in range(groups * per_group)]
    prefixes = [f"[doc {g}] " + make_prompt(rng, prefix_chars - 8) for g in range(groups)]
    out: list[tuple[str, str | None]] = []
    for i in range(per_group):
        for g in range(groups):
            question = f" Q{i}: " + make_prompt(rng, suffix_chars)
            out.append((prefixes[g] + question, prefixes[g][:HEADER_CHARS]))
    return out


async def run_routing(url: str, workload: list[tuple[str, str | None]], *, concurrency: int,
                      max_tokens: int, rate_rps: float = 0.0, model: str = "tiny") -> dict[str, Any]:
    """Send ``workload`` in order; the JSON summary.

    ``rate_rps > 0``: open loop, request k leaves at ``k / rate_rps`` s (so replies
    never pace the sends, and no router is helped by the order replies come back
    in); else closed loop with ``concurrency`` requests in flight (throughput).
    """
    start = time.monotonic()
    records: list[RequestRecord] = []
    queue: asyncio.Queue[tuple[str, str | None]] = asyncio.Queue()
    for item in workload:
        queue.put_nowait(item)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:

        async def send(prompt: str, prefix: str | None) -> None:
            rec = RequestRecord(sent=time.monotonic() - start)
            records.append(rec)
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}
            headers = {PREFIX_HEADER: prefix} if prefix else None
            await stream_completion(session, url, body, rec, start, headers)

        async def worker() -> None:
            while not queue.empty():
                await send(*queue.get_nowait())

        if rate_rps > 0:
            tasks = []
            for k, item in enumerate(workload):
                delay = start + k / rate_rps - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)  # pacing open-loop arrivals
                tasks.append(asyncio.create_task(send(*item)))
            await asyncio.gather(*tasks)
        else:
            await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.monotonic() - start
    ok = [r for r in records if r.ok]
    ttfts = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    return {
        "num_requests": len(records),
        "failed_requests": len(records) - len(ok),
        "elapsed_s": round(elapsed, 2),
        "throughput_rps": round(len(ok) / elapsed, 3),
        "output_tokens_per_s": round(sum(r.num_tokens for r in ok) / elapsed, 1),
        "prefix_cache_hit_rate": round(sum(r.cached_tokens for r in ok) / prompt_tokens, 4) if prompt_tokens else 0.0,
        "ttft_ms_p50": round(percentile(ttfts, 50), 1),
        "ttft_ms_p95": round(percentile(ttfts, 95), 1),
    }
