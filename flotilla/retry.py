"""When to retry a failed call and how long to wait: exponential backoff with jitter.

Retried: connection errors (refused, reset, dropped before an answer),
timeouts while connecting, and the statuses in ``defaults.RETRY_STATUSES``
(408, 429, 502, 503, 504), and a 500 without the OpenAI error envelope
(Serve's proxy, when the replica it picked died before answering). Never retried: other statuses, a timeout after
the connection was made (the server may still be working), and anything
after a streamed token has reached the caller (the stream code stops calling
this loop once its first token is in).
"""

from __future__ import annotations

import asyncio
import email.utils
import itertools
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from flotilla import defaults
from flotilla.errors import APIConnectionError, APIStatusError, APITimeoutError, FlotillaError

T = TypeVar("T")


def parse_retry_after(value: str | None, *, now: float | None = None) -> float | None:
    """Seconds to wait from a Retry-After header: delta-seconds or an HTTP date; None if absent or bad."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


@dataclass(frozen=True)
class RetryPolicy:
    """``max_retries`` extra attempts, waiting ``min(cap, base * 2**n)`` jittered down to half."""

    max_retries: int = defaults.MAX_RETRIES
    backoff_base_s: float = defaults.BACKOFF_BASE_S
    backoff_cap_s: float = defaults.BACKOFF_CAP_S
    retry_after_max_s: float = defaults.RETRY_AFTER_MAX_S

    def should_retry(self, error: FlotillaError) -> bool:
        """Whether ``error`` is worth another attempt (regardless of how many are left)."""
        if isinstance(error, APITimeoutError):
            return error.during_connect
        if isinstance(error, APIConnectionError):
            return True
        if not isinstance(error, APIStatusError):
            return False
        # A bare 500 (no OpenAI envelope) is the proxy saying the replica died before answering.
        return error.status in defaults.RETRY_STATUSES or (error.status == 500 and not error.enveloped)

    def delay_s(self, retry: int, error: FlotillaError | None = None) -> float:
        """The wait before retry number ``retry`` (0-based); at least the server's Retry-After."""
        backoff = min(self.backoff_cap_s, self.backoff_base_s * 2.0**retry)
        delay = backoff * (0.5 + 0.5 * random.random())  # jitter spreads clients that failed together
        retry_after = error.retry_after if isinstance(error, APIStatusError) else None
        if retry_after is not None:
            delay = max(delay, min(retry_after, self.retry_after_max_s))
        return delay

    async def call(self, attempt: Callable[[], Awaitable[T]]) -> T:
        """Await ``attempt()`` until it succeeds, fails for good, or retries run out."""
        for retry in itertools.count():
            try:
                return await attempt()
            except FlotillaError as err:
                if retry >= self.max_retries or not self.should_retry(err):
                    raise
                await asyncio.sleep(self.delay_s(retry, err))
        raise AssertionError("unreachable")  # itertools.count never ends
