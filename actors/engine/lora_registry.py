"""The engine's LoRA adapters by name: loading, unloading once their requests end, and checking requests.

Loading reads the adapter on every shard (``AddLoRA``, through ``Executor.command``); a request
names it in ``SamplingParams.lora``. Unloading stops new requests for the
adapter at once and forgets it when none is queued or running and no step
is in flight (``finish_unloads``, after each step): requests already in the
engine finish with the adapter they started with. Loading a name that is
still unloading finishes its unload first if nothing uses it any more, and
is refused as retryable (``LoRAUnloadingError``) while requests still do.

Cached KV knows an adapter by its weights, not its name: ``check`` hands each
request its adapter's digest (``actors.load.weights_digest``), which keys the
prefix cache and the KV tiers (``scheduling.lora_slots.cache_namespace``), and an
adapter forgotten drops its pages from the prefix cache.
"""

from __future__ import annotations

import time
from collections import Counter

from actors.api import LoRAInfo
from actors.commands import AddLoRA, PrepareLoRAs, RemoveLoRA
from actors.config import EngineConfig
from actors.engine.executor import Executor
from actors.errors import LoRAUnloadingError
from scheduling.batch import Batch
from scheduling.errors import InvalidParameterError
from scheduling.lora_slots import is_lora_namespace
from scheduling.policy import BatchPolicy
from scheduling.request import Request
from scheduling.sampling_params import SamplingParams, check_lora_name


class UnknownLoRAError(InvalidParameterError):
    """A request or an unload named an adapter this engine does not serve (the API answers 404)."""


class LoRARegistry:
    """Adapters of one engine; ``enabled`` mirrors ``EngineConfig.enable_lora``."""

    def __init__(self, config: EngineConfig, executor: Executor, policy: BatchPolicy) -> None:
        self.enabled = config.enable_lora
        self.executor = executor
        self.policy = policy
        self.adapters: dict[str, LoRAInfo] = {}
        self.keys: dict[str, str] = {}  # adapter -> the digest of its files, what its cached KV is keyed by
        self.unloading: set[str] = set()
        # The adapters the last planned step reads (its requests', aborted ones too, and its loads'): while
        # that step is in flight its forward may write or read their slots, so none of them is forgotten.
        self._in_step: frozenset[str] = frozenset()
        self.load_seconds: dict[str, float] = {}  # how long each adapter took to load (metrics)
        self.requests = Counter[str]()  # requests admitted per adapter (metrics)

    def add(self, name: str, path: str) -> LoRAInfo:
        check_lora_name(name, "lora_name")
        if not self.enabled:
            raise InvalidParameterError("enable_lora", "this engine was started without LoRA (enable_lora=False)")
        if name in self.unloading:  # unloaded, then loaded again (a folder change): the old one goes first
            if not self._can_forget(name, with_step_in_flight=True):
                raise LoRAUnloadingError("lora_name", f"the adapter {name!r} is still being unloaded: requests "
                                                      "still use it; retry once they have ended")  # fmt: skip
            self._forget(name)
        if name in self.adapters:
            raise InvalidParameterError("lora_name", f"an adapter named {name!r} is already loaded")
        if not isinstance(path, str) or not path:
            raise InvalidParameterError("lora_path", f"must be a folder path, got {path!r}")
        start = time.perf_counter()
        info = self.executor.command(AddLoRA(name, path))  # the shards digest the files they read (``info.key``)
        self.load_seconds[name] = time.perf_counter() - start
        self.adapters[name] = info
        self.keys[name] = info.key
        return info

    def remove(self, name: str) -> None:
        """Stop new requests for ``name``; it goes once its requests have ended (``finish_unloads``)."""
        if name not in self.adapters or name in self.unloading:
            raise UnknownLoRAError("lora_name", f"no adapter named {name!r} is loaded")
        self.unloading.add(name)
        self.finish_unloads()

    def serving(self) -> list[str]:
        """The adapters new requests may name."""
        return [n for n in self.adapters if n not in self.unloading]

    def check(self, params: SamplingParams) -> str | None:
        """Refuse a request for an adapter that is not loaded (or is unloading); else its adapter's
        ``lora_key`` (``scheduling.request.Request``), None for the base model."""
        name = params.lora
        if name is None:
            return None
        if not self.enabled:
            raise InvalidParameterError("lora", "this engine serves no LoRA adapters (enable_lora=False)")
        if name not in self.adapters or name in self.unloading:
            raise UnknownLoRAError("lora", f"no adapter named {name!r} is loaded")
        self.requests[name] += 1
        return self.keys[name]

    def planned(self, batch: Batch, requests: list[Request]) -> None:
        """``batch`` (planned for ``requests``) is the step now in flight."""
        loads = {n for _, n in batch.lora.loads or ()}
        self._in_step = frozenset({r.params.lora for r in requests if r.params.lora is not None} | loads)

    def finish_unloads(self) -> None:
        """Forget each unloading adapter no request uses, when no step is in flight (its batch may load it)."""
        for name in [n for n in self.unloading if self._can_forget(n, with_step_in_flight=False)]:
            self._forget(name)

    def _can_forget(self, name: str, *, with_step_in_flight: bool) -> bool:
        """No queued or running request uses ``name``, and no step is in flight, or (``with_step_in_flight``:
        the caller runs between forwards, as ``add`` does on the engine's thread) the step in flight does
        not read it."""
        if self.policy.uses_lora(name):
            return False
        return not self.policy.has_step_in_flight or (with_step_in_flight and name not in self._in_step)

    def _forget(self, name: str) -> None:
        if self.policy.lora is not None:
            self.policy.lora.forget(name)
        self.executor.command(RemoveLoRA(name))
        del self.adapters[name]
        self.unloading.discard(name)
        self._drop_cached(self.keys.pop(name))

    def _drop_cached(self, key: str) -> None:
        # A forgotten adapter's KV is never served again: the same name may come back with other weights
        # (then under another key, so the tiers' blocks are out of reach too), and its pages serve no one
        # meanwhile. Kept while another loaded name has the same weights: their requests may read them.
        cache = self.policy.cache
        if cache is not None and key not in self.keys.values():
            cache.evict_namespaces(lambda ns: is_lora_namespace(ns, key))

    def prepare(self, batch: Batch) -> dict[str, str]:
        """Have a planned step's adapter loads read on the shards before it runs; adapter -> why one failed.

        An adapter evicted from the shards' host cache is read from its folder
        again here, not in the forward, so a folder gone bad fails that
        adapter's requests (``LLMEngine``), not the whole step.
        """
        assert batch.lora.loads, "only a step that writes adapters into slots has loads to prepare"
        return self.executor.command(PrepareLoRAs(tuple(dict.fromkeys(name for _, name in batch.lora.loads))))

    def unassign(self, name: str) -> None:
        """``name`` was not written into the slot it was given (its requests have ended): free the slot,
        so that its next request loads it again rather than reading the slot's stale weights."""
        if self.policy.lora is not None:
            self.policy.lora.forget(name)

    def shards_restarted(self) -> None:
        """The shards were rebuilt with empty LoRA slots: every adapter must be written again when used."""
        if self.policy.lora is not None:
            self.policy.lora.reset()
