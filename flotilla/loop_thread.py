"""A private asyncio loop on a daemon thread, so blocking code can drive async code.

``Client`` runs ``AsyncClient`` here. Works from plain scripts; calling from
inside the loop's own thread is refused (it would wait on itself forever).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from flotilla.errors import FlotillaError

T = TypeVar("T")
JOIN_TIMEOUT_S = 10.0


class LoopThread:
    """Starts its loop at construction; :meth:`close` stops it and joins the thread."""

    def __init__(self, name: str = "flotilla-client") -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and block for its result; an interrupt cancels it."""
        if self._closed:
            coro.close()
            raise FlotillaError("the client is closed")
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("a flotilla Client cannot be called from its own event loop thread")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # e.g. KeyboardInterrupt: stop the request, not just the wait
            raise

    def close(self) -> None:
        """Stop the loop and join its thread; later ``run`` calls fail. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(JOIN_TIMEOUT_S)
        if not self._thread.is_alive():
            self._loop.close()
