"""Run many calls with bounded concurrency; results in input order, one failure per item."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from flotilla.errors import FlotillaError
from flotilla.progress import ProgressBar
from flotilla.types import BatchResult, Completion

T = TypeVar("T")


async def run_batch(items: Sequence[T], call: Callable[[T], Awaitable[Completion]], *,
                    concurrency: int, progress: ProgressBar) -> list[BatchResult]:
    """``call`` each item, at most ``concurrency`` at once.

    A ``FlotillaError`` becomes that item's ``BatchResult.error`` and the rest
    go on; any other exception (a bug) cancels the batch and propagates.
    """
    results: list[BatchResult | None] = [None] * len(items)
    next_index = iter(range(len(items)))

    async def worker() -> None:
        for i in next_index:  # shared iterator: each index is taken by exactly one worker
            try:
                result = BatchResult(i, completion=await call(items[i]))
            except FlotillaError as exc:
                result = BatchResult(i, error=exc)
            results[i] = result
            progress.advance(failed=not result.ok)

    tasks = [asyncio.ensure_future(worker()) for _ in range(max(1, min(concurrency, len(items))))]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    finally:
        progress.close()
    assert all(r is not None for r in results)  # every index was taken by a worker
    return [r for r in results if r is not None]
