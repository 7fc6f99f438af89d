"""Which LoRA adapters sit in the model runner's ``max_loras`` slots, decided by the scheduler.

A running request pins its adapter's slot (``acquire`` at admission,
``release`` when it finishes, is aborted or is preempted). A request whose
adapter is not resident takes a free slot, else the least recently used
unpinned one (that adapter is evicted from the device; the runner keeps its
weights on the host); when every slot is pinned by other adapters it waits.
Each newly filled slot is reported once (``take_loads``) in the next
``Batch``, whose ``lora_loads`` the runner writes before that step's forward,
so a step never runs on a slot it has not loaded.

Invariants: ``slot_of`` and ``names`` are inverse maps; a pinned slot is
never reassigned; pins count the requests holding the slot.
"""

from __future__ import annotations

from collections import OrderedDict

_LORA_MARK = "\x00lora:"
NO_LORA = -1  # the slot of a sequence (and of its tokens in ``actors.models.lora``) served by the base model


def cache_namespace(namespace: str | None, lora_key: str | None) -> str | None:
    """The prefix-cache namespace of a request: KV computed under one adapter's weights never serves another.

    ``lora_key`` names the adapter's weights, not the adapter: its files' digest
    (``actors.load.weights_digest``), so an adapter loaded again from other files
    under the same name, or another app's adapter of that name, never meets this KV.
    The tiers' block keys are seeded with this namespace too (``kvcache.kv_blocks.block_salt``).
    Keys are printable (hex digests; a bare scheduler keys by names, which are printable,
    ``check_lora_name``), so the NUL separator cannot make two (namespace, adapter) pairs collide.
    """
    if lora_key is None:
        return namespace
    return f"{namespace or ''}{_LORA_MARK}{lora_key}"


def is_lora_namespace(cache_ns: str | None, lora_key: str) -> bool:
    """Whether ``cache_ns`` (a ``cache_namespace``) holds KV computed under adapter weights ``lora_key``."""
    return cache_ns is not None and cache_ns.endswith(f"{_LORA_MARK}{lora_key}")


class LoRASlots:
    """Slot assignment for up to ``max_loras`` resident adapters."""

    def __init__(self, max_loras: int) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}")
        self.max_loras = max_loras
        self.slot_of: dict[str, int] = {}
        self.names: list[str | None] = [None] * max_loras
        self.pins = [0] * max_loras
        self._lru: OrderedDict[int, None] = OrderedDict()  # unpinned resident slots, least recent first
        self._loads: list[tuple[int, str]] = []

    def acquire(self, name: str) -> int | None:
        """Pin ``name``'s slot for one more request, filling one if needed; None when none can be had."""
        slot = self.slot_of.get(name)
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                return None
            old = self.names[slot]
            if old is not None:
                del self.slot_of[old]
            self.names[slot] = name
            self.slot_of[name] = slot
            self._loads = [(s, n) for s, n in self._loads if s != slot]  # a load not yet sent is superseded
            self._loads.append((slot, name))
        self._lru.pop(slot, None)
        self.pins[slot] += 1
        return slot

    def release(self, slot: int) -> None:
        """One request let go of ``slot``."""
        assert self.pins[slot] > 0, f"slot {slot} is not pinned"
        self.pins[slot] -= 1
        if self.pins[slot] == 0:
            self._lru[slot] = None

    def forget(self, name: str) -> None:
        """Drop an unloaded adapter's slot (it must hold no request)."""
        slot = self.slot_of.pop(name, None)
        if slot is None:
            return
        assert self.pins[slot] == 0, f"adapter {name!r} still serves {self.pins[slot]} request(s)"
        self.names[slot] = None
        self._lru.pop(slot, None)
        self._loads = [(s, n) for s, n in self._loads if s != slot]

    def reset(self) -> None:
        """Empty every slot (the runner's slots were lost with its shards); no request may hold one."""
        assert not any(self.pins), f"slots still pinned: {self.pins}"
        self.slot_of.clear()
        self.names = [None] * self.max_loras
        self._lru.clear()
        self._loads.clear()

    def in_use(self, name: str) -> bool:
        slot = self.slot_of.get(name)
        return slot is not None and self.pins[slot] > 0

    def take_loads(self) -> list[tuple[int, str]]:
        """The (slot, adapter) fills since the last call, for the next batch."""
        loads, self._loads = self._loads, []
        return loads

    def _free_slot(self) -> int | None:
        for slot, name in enumerate(self.names):
            if name is None:
                return slot
        if self._lru:
            return next(iter(self._lru))
        return None
