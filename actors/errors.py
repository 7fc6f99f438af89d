"""Typed errors of the execution layer."""

from __future__ import annotations

from scheduling.errors import InvalidParameterError


class ExecutorFailure(RuntimeError):
    """A step could not run because a model shard failed or died.

    Every request in that step (and every running request, whose KV lives in
    the shards) ends with finish_reason "error" carrying this message; the
    executor is then restarted.
    """


class LoRAUnloadingError(InvalidParameterError):
    """A load named an adapter still being unloaded for requests that use it: retry once they have ended.

    Raised by the engine (``actors.engine.lora_registry``); the replica answers it as retryable.
    """
