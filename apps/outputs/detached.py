"""Tasks that outlive the request that started them.

Ray cancels a cancelled actor task's child tasks recursively, and it finds
the children through a context variable (``ray._raylet.async_task_id``) that
``asyncio.create_task`` copies into every task a request handler starts. So
a Ray call made from such a task (the replica's output poll, the abort of a
request whose client left) would itself be cancelled when that one client
disconnects. ``detached`` runs the coroutine in an empty context instead:
its Ray calls have no parent to be cancelled with.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def detached(coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
    """Start ``coro`` on the running loop in a fresh, empty context."""
    return asyncio.get_running_loop().create_task(coro, context=contextvars.Context())
