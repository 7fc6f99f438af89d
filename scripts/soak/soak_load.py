"""The soak's steady load: ``concurrency`` workers send requests back to back through the SDK.

Each request is a completion or a chat, streamed or whole, with a small random
``max_tokens``; the SDK retries what fails before a first token. Every request
is bounded by ``timeout_s`` on our side: one that does not end in time counts
as hung (the failure the soak exists to catch); an error the server or the SDK
reports is counted by kind, with a few samples kept for the summary.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from apps.protocol.errors import INTERNAL_ERROR_MESSAGE
from flotilla import AsyncClient
from flotilla.errors import APIStatusError, FlotillaError


@dataclass
class LoadStats:
    ok: int = 0
    error: int = 0
    hung: int = 0  # still running past its timeout (an SDK timeout AT the deadline is an error)
    unclear: int = 0  # no message, or flotilla's generic 500: a client cannot tell what happened
    errors_by_kind: Counter[str] = field(default_factory=Counter)  # "ErrorClass status: message"
    hung_samples: list[str] = field(default_factory=list)
    latencies_s: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        lat = sorted(self.latencies_s)
        p = (lambda q: round(lat[min(len(lat) - 1, int(q * len(lat)))], 3)) if lat else (lambda q: None)
        return {"ok": self.ok, "error": self.error, "hung": self.hung, "unclear_errors": self.unclear,
                "errors_by_kind": dict(self.errors_by_kind.most_common()),
                "hung_samples": self.hung_samples[:5], "latency_s_p50": p(0.5), "latency_s_p99": p(0.99)}


async def _one(client: AsyncClient, rng: random.Random, n: int) -> None:
    max_tokens = rng.randint(4, 48)
    prompt = f"soak request {n}: " + rng.choice(["tell a story", "list numbers", "the sea", "hello"])
    if rng.random() < 0.5:
        stream = client.stream(prompt, max_tokens=max_tokens) if rng.random() < 0.5 else \
            client.stream_chat(prompt, max_tokens=max_tokens)
        async with stream:
            async for _ in stream:
                pass
    elif rng.random() < 0.5:
        await client.complete(prompt, max_tokens=max_tokens)
    else:
        await client.chat(prompt, max_tokens=max_tokens)


async def _worker(url: str, stats: LoadStats, stop: asyncio.Event, seed: int, timeout_s: float) -> None:
    rng = random.Random(seed)
    n = 0
    async with AsyncClient(url, timeout=timeout_s, max_retries=4, backoff_base=0.5, backoff_cap=4.0) as client:
        while not stop.is_set():
            n += 1
            start = time.monotonic()
            try:
                # The SDK bounds the call; this outer bound (a little longer) catches anything that does not.
                await asyncio.wait_for(_one(client, rng, n), timeout_s + 10.0)
            except (TimeoutError, asyncio.TimeoutError):  # noqa: UP041 - spelled out for 3.10
                stats.hung += 1
                stats.hung_samples.append(f"worker {seed} request {n}")
                continue
            except FlotillaError as err:
                stats.error += 1
                kind = type(err).__name__ + (f" {err.status}" if isinstance(err, APIStatusError) else "")
                stats.errors_by_kind[f"{kind}: {err.message[:90]}"] += 1
                if not err.message or err.message == INTERNAL_ERROR_MESSAGE:
                    stats.unclear += 1  # flotilla's catch-all: an exception nobody turned into a reason
                continue
            stats.ok += 1
            stats.latencies_s.append(time.monotonic() - start)


async def run_load(url: str, *, concurrency: int, seed: int, timeout_s: float, stop: asyncio.Event,
                   stats: LoadStats) -> None:
    """Run until ``stop`` is set; requests in flight then finish (each is bounded)."""
    await asyncio.gather(*(_worker(url, stats, stop, seed * 1000 + i, timeout_s) for i in range(concurrency)))
