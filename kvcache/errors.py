"""Typed errors of the KV cache layer."""

from __future__ import annotations


class OutOfPagesError(RuntimeError):
    """More pages were asked for than the allocator has free.

    The scheduler treats this as a signal to evict or preempt; it is never
    shown to users as such.
    """

    def __init__(self, num_requested: int, num_free: int) -> None:
        super().__init__(f"asked for {num_requested} KV pages but only {num_free} are free")
        self.num_requested = num_requested
        self.num_free = num_free


class CacheConfigError(ValueError):
    """A KV cache setting cannot be met (for example max_model_len beyond the pool).

    ``param`` names the engine setting at fault; the message gives both numbers.
    """

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message
