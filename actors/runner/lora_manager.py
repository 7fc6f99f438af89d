"""The model runner's LoRA adapters: registered by name, cached on the host, written into device slots.

``add`` reads and checks an adapter (``actors.load.lora_adapter``) against
this model's shapes and keeps it in a host LRU of ``max_cpu_loras``
adapters. An evicted one is read again from its folder when next needed,
before the step that writes it (``prepare``, called by the engine between
planning a step and running it), so a folder gone bad fails that adapter
alone, not the step.
The scheduler decides which adapter sits in which of the ``max_loras``
device slots (``scheduling.lora_slots``); a ``Batch``'s ``lora_loads`` are
written before its forward (``load_slots``), and its ``lora_slots`` become
the step's token grouping (``begin_step``) that every LoRA layer reads.

Slots sit on every dense projection a layer has. A mixture-of-experts
layer's experts take none (``actors.models.moe.SparseMoE`` is one fused
module, not per-expert linears): an adapter that targets a projection the
model lacks in some layer is refused naming it, so on a MoE model
attention-only adapters are served.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from actors.api import LoRAInfo
from actors.load.lora_adapter import (
    LORA_TARGETS,
    LoRAAdapter,
    LoRAPart,
    read_adapter,
    weight_bytes_bound,
)
from actors.load.weights_digest import adapter_digest
from actors.log import get_logger
from actors.models.layers import ParallelLinear
from actors.models.lora import LoRAContext, LoRAStep, LoRAWeights
from scheduling.batch import Batch
from scheduling.errors import InvalidParameterError

logger = get_logger(__name__.rsplit(".", 1)[-1])


CHANGED = "its files changed since it was loaded (unload and load it again to serve the new files)"


class AdapterFilesChanged(InvalidParameterError):
    """A registered adapter's files, read again after an eviction, are not those it was loaded from."""


class LoRAManager:
    """LoRA slots on every adaptable linear layer of ``layers`` (the decoder layers), plus the host cache."""

    def __init__(
        self, layers: nn.ModuleList, *, max_loras: int, max_rank: int, max_cpu_loras: int,
        dtype: torch.dtype, device: torch.device,
    ) -> None:  # fmt: skip
        self.context = LoRAContext()
        self.max_rank, self.max_cpu_loras, self.device = max_rank, max_cpu_loras, device
        self.num_layers = len(layers)
        self.layers: dict[tuple[int, str], ParallelLinear] = {}
        for i, layer in enumerate(layers):
            for module in dict.fromkeys(m for m, _ in LORA_TARGETS.values()):
                try:
                    linear = layer.get_submodule(module)
                except AttributeError:  # a MoE layer's mlp has no dense projections: no slots there
                    continue
                assert isinstance(linear, ParallelLinear), (module, type(linear))
                linear.lora = LoRAWeights(
                    self.context, max_loras=max_loras, max_rank=max_rank, part_sizes=linear.lora_part_sizes(),
                    in_features=linear.in_features, dtype=dtype, device=device,
                )  # fmt: skip
                self.layers[(i, module)] = linear
        dims = [linear.lora_dims(part) for linear in self.layers.values() for part in linear.shard_ids]
        self.max_weight_bytes = weight_bytes_bound(dims, max_rank)  # what no adapter file may exceed
        self.paths: dict[str, Path] = {}  # every registered adapter's folder
        # Each registered adapter's digest at add: a re-read (after host-cache eviction) of other files would
        # serve other weights under KV keyed by these, so it is refused.
        self.keys: dict[str, str] = {}
        self._host: OrderedDict[str, LoRAAdapter] = OrderedDict()  # least recently used first
        # What ``prepare`` made ready for the next step's loads: out of the LRU's reach until written.
        self._ready: dict[str, LoRAAdapter] = {}
        self.slot_names: list[str | None] = [None] * max_loras
        # add/remove may run beside a step (a shard actor's second thread): the registry and the host
        # cache change under this lock. Reading an adapter's files happens outside it.
        self._lock = threading.Lock()

    def add(self, name: str, path: str | Path) -> LoRAInfo:
        """Register adapter ``name`` from ``path``, checked against this model; refusals raise ``InvalidParameterError``."""
        if name in self.paths:
            raise InvalidParameterError("lora_name", f"an adapter named {name!r} is already loaded")
        adapter = self._read(name, Path(path))  # first: it refuses files too large to read (or hash)
        # The files just read (one replaced between the read and the digest is a race the caller made: load
        # the adapter again); a re-read after an eviction must find the same (``_read_again``).
        key = adapter_digest(adapter.path)
        with self._lock:
            self.paths[name] = adapter.path
            self.keys[name] = key
            self._cache(adapter)
        return LoRAInfo(name, str(adapter.path), adapter.rank, adapter.targets, key)

    def remove(self, name: str) -> None:
        """Forget ``name`` (the scheduler has released its slot: no step uses it)."""
        with self._lock:
            self.paths.pop(name, None)
            self.keys.pop(name, None)
            self._host.pop(name, None)
            self._ready.pop(name, None)
        for slot, held in enumerate(self.slot_names):
            if held == name:
                self.slot_names[slot] = None

    def prepare(self, names: list[str]) -> dict[str, str]:
        """Have each adapter of ``names`` (the next step's loads) read and held for ``load_slots``.

        One evicted from the host cache is read again now, outside the step.
        Returns adapter -> why it could not be read, for those that failed
        (the engine ends their requests and drops their loads; the detail is
        logged, since it names the server's folder).
        """
        failed: dict[str, str] = {}
        with self._lock:  # what an earlier prepare held for a step that never loaded it (failed on a peer rank)
            self._ready.clear()
        for name in names:
            with self._lock:
                adapter = self._host.get(name)
                path = self.paths.get(name)
            if adapter is None and path is not None:
                try:
                    adapter = self._read_again(name, path)
                except AdapterFilesChanged:
                    failed[name] = CHANGED
                    continue
                except (InvalidParameterError, OSError) as e:
                    logger.error("LoRA adapter %r could not be read again: %s", name, e)
                    failed[name] = "its files could not be read again"
                    continue
            if adapter is None:
                failed[name] = "it is not registered"
                continue
            with self._lock:
                self._ready[name] = adapter
        return failed

    def load_slots(self, loads: list[tuple[int, str]]) -> None:
        """Write each (slot, adapter) into every layer's slot (the batch's ``lora_loads``)."""
        for slot, name in loads:
            with self._lock:
                adapter = self._ready.pop(name, None) or self._host.get(name)
                path = self.paths[name]
            if adapter is None:  # not prepared (a caller that skipped ``prepare``): read it here
                adapter = self._read_again(name, path)
            with self._lock:
                self._cache(adapter)
            for linear in self.layers.values():
                assert linear.lora is not None
                linear.lora.clear(slot)
            for part in adapter.parts:
                linear = self.layers[(part.layer, part.module)]
                assert linear.lora is not None
                a, b = linear.lora_slice(part.part, part.a, part.b)
                dtype = linear.lora.dtype
                linear.lora.set_part(slot, linear.shard_ids.index(part.part),
                                     a.to(self.device, dtype), b.to(self.device, dtype))  # fmt: skip
            self.slot_names[slot] = name

    def begin_step(self, batch: Batch) -> None:
        """Set the step's token grouping from ``batch.lora.slots`` (cleared when it has none)."""
        if batch.lora.loads:
            self.load_slots(batch.lora.loads)
        slots = batch.lora.slots
        if slots is None:
            self.context.step = None
            return
        token_slots = [s for s, n in zip(slots, batch.query_lens, strict=True) for _ in range(n)]
        self.context.step = LoRAStep.build(token_slots, self.device)

    def end_step(self) -> None:
        self.context.step = None

    def _read_again(self, name: str, path: Path) -> LoRAAdapter:
        """Read a registered adapter evicted from the host cache: the same files only, or ``AdapterFilesChanged``."""
        if adapter_digest(path) != self.keys[name]:
            raise AdapterFilesChanged("lora_path", f"adapter {name!r}: {CHANGED}")
        return self._read(name, path)

    def _read(self, name: str, path: Path) -> LoRAAdapter:
        # Every tensor's shape is checked against this model from the file's header, before it is read.
        adapter = read_adapter(name, path, max_rank=self.max_rank, num_layers=self.num_layers,
                               max_weight_bytes=self.max_weight_bytes, module_dims=self.module_dims)
        return replace(adapter, parts=tuple(p for part in adapter.parts for p in self._split_fused(part)))

    def module_dims(self, layer: int, hf_module: str) -> tuple[int, int] | None:
        """The full (in, out) features of ``hf_module`` in ``layer`` as an adapter holds them (a fused module's
        out: all its parts'); None where the layer has no such dense projection (``ModuleDims``)."""
        module, part = LORA_TARGETS[hf_module]
        linear = self.layers.get((layer, module))
        if linear is None:
            return None
        if part is None and len(linear.shard_ids) > 1:
            dims = [linear.lora_dims(shard) for shard in linear.shard_ids]
            return dims[0][0], sum(out for _, out in dims)
        return linear.lora_dims(part)

    def _split_fused(self, part: LoRAPart) -> tuple[LoRAPart, ...]:
        """A fused module's adapter (Phi-3's ``qkv_proj``: part None on a layer of several parts) as one part per
        fused part: each keeps the shared ``a`` and its own rows of ``b``, which is exactly the fused product
        (``module_dims`` checked that ``b`` has every part's rows)."""
        linear = self.layers[(part.layer, part.module)]
        if part.part is not None or len(linear.shard_ids) == 1:
            return (part,)
        rows = part.b.split([linear.lora_dims(shard)[1] for shard in linear.shard_ids])
        return tuple(replace(part, part=shard, b=b) for shard, b in zip(linear.shard_ids, rows, strict=True))

    def _cache(self, adapter: LoRAAdapter) -> None:
        self._host[adapter.name] = adapter
        self._host.move_to_end(adapter.name)
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)
