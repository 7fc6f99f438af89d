"""Replicas' view of the application's adapter catalog, without Ray: the catalog alone decides what is served.

Two ``ReplicaLoRAs`` share one in-process catalog, each over a stand-in
engine that records its loads and unloads. An adapter unloaded through one
replica is 404 at once on the other (which then unloads it from its engine),
a name registered again with another folder is reloaded from it, and
concurrent first requests load an adapter once.
"""

from __future__ import annotations

import asyncio
from typing import cast

import pytest

from actors.remote.scheduler_handle import SchedulerHandle
from actors.runner.lora_manager import LoRAInfo
from apps.errors import APIError
from apps.lora_serving import LoRACatalog, ReplicaLoRAs


class LocalCatalog:
    """``CatalogHandle`` over an in-process ``LoRACatalog``."""

    def __init__(self) -> None:
        self.inner = LoRACatalog()

    async def add(self, name: str, path: str) -> bool:
        return self.inner.add(name, path)

    async def remove(self, name: str) -> bool:
        return self.inner.remove(name)

    async def get(self, name: str) -> str | None:
        return self.inner.get(name)

    async def items(self) -> dict[str, str]:
        return self.inner.items()


class Engine:
    """The scheduler handle's LoRA calls, recorded; a load yields once so concurrent callers overlap."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    async def add_lora(self, name: str, path: str) -> LoRAInfo:
        await asyncio.sleep(0)
        self.calls.append(("add", f"{name}={path}"))
        return LoRAInfo(name=name, path=path, rank=8, targets=("q_proj",))

    async def remove_lora(self, name: str) -> None:
        self.calls.append(("remove", name))


def _replicas() -> tuple[LocalCatalog, list[Engine], list[ReplicaLoRAs]]:
    catalog = LocalCatalog()
    engines = [Engine(), Engine()]
    replicas = [ReplicaLoRAs(cast(SchedulerHandle, e), catalog, "base") for e in engines]
    return catalog, engines, replicas


def test_unloaded_through_one_replica_is_404_on_the_other_at_once() -> None:
    async def run() -> None:
        catalog, engines, (one, two) = _replicas()
        await one.load("a", "/adapters/a")
        assert await two.resolve("a") == "a" and await two.resolve("a") == "a"
        assert engines[1].calls == [("add", "a=/adapters/a")]  # loaded once, then resident
        await one.unload("a")
        assert engines[0].calls[-1] == ("remove", "a")
        for replica in (two, one):
            with pytest.raises(APIError) as err:
                await replica.resolve("a")
            assert err.value.status == 404 and err.value.param == "model"
        assert engines[1].calls[-1] == ("remove", "a") and "a" not in two.loaded
        with pytest.raises(APIError):
            await two.check_known("a")
        assert await two.resolve("base") is None and await two.resolve(None) is None

    asyncio.run(run())


def test_a_name_registered_again_with_another_folder_is_reloaded_from_it() -> None:
    async def run() -> None:
        catalog, engines, (one, two) = _replicas()
        await one.load("a", "/adapters/a1")
        await two.resolve("a")
        await one.unload("a")
        await one.load("a", "/adapters/a2")
        assert await two.resolve("a") == "a"
        assert engines[1].calls == [("add", "a=/adapters/a1"), ("remove", "a"), ("add", "a=/adapters/a2")]
        assert two.loaded["a"].path == "/adapters/a2"

    asyncio.run(run())


def test_concurrent_first_requests_load_once() -> None:
    async def run() -> None:
        catalog, engines, (one, two) = _replicas()
        assert await catalog.add("a", "/adapters/a")
        assert await asyncio.gather(*(two.resolve("a") for _ in range(5))) == ["a"] * 5
        assert engines[1].calls == [("add", "a=/adapters/a")]
        with pytest.raises(APIError) as err:
            await two.resolve("nope")
        assert err.value.status == 404

    asyncio.run(run())
