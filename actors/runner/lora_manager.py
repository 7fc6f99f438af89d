"""The model runner's LoRA adapters: registered by name, cached on the host, written into device slots.

``add`` reads and checks an adapter (``actors.load.lora_adapter``) against
this model's shapes and keeps it in a host LRU of ``max_cpu_loras``
adapters (an evicted one is read again from its folder when next needed).
The scheduler decides which adapter sits in which of the ``max_loras``
device slots (``scheduling.lora_slots``); a ``Batch``'s ``lora_loads`` are
written before its forward (``load_slots``), and its ``lora_slots`` become
the step's token grouping (``begin_step``) that every LoRA layer reads.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from actors.load.lora_adapter import LoRAAdapter, read_adapter
from actors.models.layers import ParallelLinear
from actors.models.lora import LoRAContext, LoRAStep, LoRAWeights
from scheduling.batch import Batch
from scheduling.errors import InvalidParameterError


@dataclass(frozen=True)
class LoRAInfo:
    """What ``add`` reports about an adapter (the API lists it)."""

    name: str
    path: str
    rank: int
    targets: tuple[str, ...]


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
            for module in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
                linear = layer.get_submodule(module)
                assert isinstance(linear, ParallelLinear), (module, type(linear))
                linear.lora = LoRAWeights(
                    self.context, max_loras=max_loras, max_rank=max_rank, part_sizes=linear.lora_part_sizes(),
                    in_features=linear.in_features, dtype=dtype, device=device,
                )  # fmt: skip
                self.layers[(i, module)] = linear
        self.paths: dict[str, Path] = {}  # every registered adapter's folder
        self._host: OrderedDict[str, LoRAAdapter] = OrderedDict()  # least recently used first
        self.slot_names: list[str | None] = [None] * max_loras
        # add/remove may run beside a step (a shard actor's second thread): the registry and the host
        # cache change under this lock. Reading an adapter's files happens outside it.
        self._lock = threading.Lock()

    def add(self, name: str, path: str | Path) -> LoRAInfo:
        """Register adapter ``name`` from ``path``, checked against this model; refusals raise ``InvalidParameterError``."""
        if name in self.paths:
            raise InvalidParameterError("lora_name", f"an adapter named {name!r} is already loaded")
        adapter = self._read(name, Path(path))
        with self._lock:
            self.paths[name] = adapter.path
            self._cache(adapter)
        return LoRAInfo(name, str(adapter.path), adapter.rank, adapter.targets)

    def remove(self, name: str) -> None:
        """Forget ``name`` (the scheduler has released its slot: no step uses it)."""
        with self._lock:
            self.paths.pop(name, None)
            self._host.pop(name, None)
        for slot, held in enumerate(self.slot_names):
            if held == name:
                self.slot_names[slot] = None

    def load_slots(self, loads: list[tuple[int, str]]) -> None:
        """Write each (slot, adapter) into every layer's slot (the batch's ``lora_loads``)."""
        for slot, name in loads:
            with self._lock:
                adapter = self._host.get(name)
                if adapter is not None:
                    self._host.move_to_end(name)
                path = self.paths[name]
            if adapter is None:  # evicted from the host cache: read it again
                adapter = self._read(name, path)
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
        """Set the step's token grouping from ``batch.lora_slots`` (cleared when it has none)."""
        if batch.lora_loads:
            self.load_slots(batch.lora_loads)
        slots = batch.lora_slots
        if slots is None:
            self.context.step = None
            return
        token_slots = [s for s, n in zip(slots, batch.query_lens, strict=True) for _ in range(n)]
        self.context.step = LoRAStep.build(token_slots, self.device)

    def end_step(self) -> None:
        self.context.step = None

    def _read(self, name: str, path: Path) -> LoRAAdapter:
        adapter = read_adapter(name, path, max_rank=self.max_rank, num_layers=self.num_layers)
        for part in adapter.parts:
            linear = self.layers[(part.layer, part.module)]
            want = linear.lora_dims(part.part)
            got = (part.a.shape[1], part.b.shape[0])
            if got != want:
                raise InvalidParameterError(
                    "lora_path", f"adapter {str(path)!r}: layer {part.layer} {part.module} part {part.part!r} is "
                    f"{got[0]} -> {got[1]} features, the base model's is {want[0]} -> {want[1]}: it was "
                    "trained on another base model",
                )  # fmt: skip
        return adapter

    def _cache(self, adapter: LoRAAdapter) -> None:
        self._host[adapter.name] = adapter
        self._host.move_to_end(adapter.name)
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)
