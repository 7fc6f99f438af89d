"""Typed errors of the execution layer."""

from __future__ import annotations


class ExecutorFailure(RuntimeError):
    """A step could not run because a model shard failed or died.

    Every request in that step (and every running request, whose KV lives in
    the shards) ends with finish_reason "error" carrying this message; the
    executor is then restarted.
    """
