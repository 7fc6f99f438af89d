"""The benchmarks' one streaming client: send a request, time its SSE chunks, count tokens from usage.

``flotilla bench serve``, ``bench autoscale`` and ``bench pd`` measure what a
client sees through ``stream_request``. Events are parsed by the SDK's SSE
decoder (``flotilla.sse``). Token counts come only from the server's
``usage`` (``stream_options.include_usage``), never from counting chunks: a
server merges several engine steps into one chunk when its reader falls
behind, exactly under load, so chunks undercount tokens there. A stream
without usage is a failed request, naming why.

Times, in seconds from the send: TTFT to the first chunk that brings output
(text or a finish: a detokenizer may hold text back until the finish), ITL
the gaps between such chunks, E2E to the stream's end, TPOT
``(E2E - TTFT) / (output_tokens - 1)`` (``tpot_s``, the one definition).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from flotilla.sse import DONE, iter_sse

ERROR_CHARS = 200  # of a server's error text kept in a result


def tpot_s(ttft_s: float | None, e2e_s: float | None, output_tokens: int) -> float | None:
    """Mean time per output token after the first; None with fewer than two tokens."""
    if ttft_s is None or e2e_s is None or output_tokens < 2:
        return None
    return (e2e_s - ttft_s) / (output_tokens - 1)


@dataclass(slots=True)
class RequestResult:
    """One request's outcome, times in seconds from the client's view."""

    ok: bool
    start_s: float = 0.0  # when sent, after the run's start (set by the caller)
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # gaps between output chunks
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    finish_reasons: list[str] = field(default_factory=list)
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        return tpot_s(self.ttft_s, self.e2e_s, self.output_tokens)


def _has_output(chunk: dict[str, Any]) -> bool:
    """A chunk that brings generated output: text, or a finish (whose text a detokenizer may have held back).

    A chat stream's opening role-only chunk and the final usage chunk bring none.
    """
    for choice in chunk.get("choices") or []:
        if choice.get("text") or (choice.get("delta") or {}).get("content") or choice.get("finish_reason"):
            return True
    return False


async def stream_request(session: aiohttp.ClientSession, url: str, body: dict[str, Any], *,
                         headers: dict[str, str] | None = None,
                         on_first_output: Callable[[], None] | None = None) -> RequestResult:
    """POST ``body`` (a streaming request) to ``url`` and time it; never raises for server or network errors.

    ``on_first_output`` runs when the first output chunk arrives (a sampler
    that counts queued requests needs to know before the stream ends).
    """
    t0 = time.perf_counter()
    result = RequestResult(ok=False)
    last: float | None = None
    usage: dict[str, Any] | None = None
    try:
        async with session.post(url, json=body, headers=headers or {}) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:ERROR_CHARS]}"
                return result
            async for data in iter_sse(resp.content):
                if data == DONE:
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    err = chunk["error"]
                    result.error = str(err.get("message", err) if isinstance(err, dict) else err)[:ERROR_CHARS]
                    return result
                now = time.perf_counter()
                if _has_output(chunk):
                    if last is None:
                        result.ttft_s = now - t0
                        if on_first_output is not None:
                            on_first_output()
                    else:
                        result.itl_s.append(now - last)
                    last = now
                result.finish_reasons += [c["finish_reason"] for c in chunk.get("choices") or []
                                          if c.get("finish_reason")]
                usage = chunk.get("usage") or usage
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:ERROR_CHARS]
        return result
    result.e2e_s = time.perf_counter() - t0
    if usage is None:
        result.error = "the stream carried no usage (the benchmarks send stream_options.include_usage)"
        return result
    result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    result.output_tokens = int(usage.get("completion_tokens") or 0)
    result.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    if not result.finish_reasons:
        result.error = "the stream ended without a finish reason"
        return result
    result.ok = True
    return result


async def resolve_model(session: aiohttp.ClientSession, base_url: str) -> str:
    """The first model ``/v1/models`` lists."""
    async with session.get(base_url + "/v1/models") as resp:
        resp.raise_for_status()
        data = await resp.json()
    return str(data["data"][0]["id"])
