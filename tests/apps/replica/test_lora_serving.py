"""Replicas' view of the application's adapter catalog, without Ray: the catalog alone decides what is served.

Two ``ReplicaLoRAs`` share one in-process catalog, each over a stand-in
engine that records its loads and unloads. An adapter unloaded through one
replica is 404 at once on the other (which then unloads it from its engine),
a name registered again with another folder is reloaded from it, and
concurrent first requests load an adapter once. Runtime loading is off
unless asked for; folders are normalised (one adapter, one load); a
redeploy's ``lora_modules`` replace the previous deployment's.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import cast

import pytest

from actors.api import LoRAInfo
from actors.commands import AddLoRA, RemoveLoRA
from actors.errors import LoRAUnloadingError
from actors.scheduler.handle import SchedulerHandle
from apps.outputs.http_responses import RETRY_AFTER_S, error_json
from apps.protocol.errors import APIError
from apps.replica.lora import LoRACatalog, ReplicaLoRAs, checked_modules, lora_folder
from scheduling.errors import InvalidParameterError


class LocalCatalog:
    """``CatalogHandle`` over an in-process ``LoRACatalog``."""

    def __init__(self) -> None:
        self.inner = LoRACatalog()

    async def configure(self, modules: dict[str, str], runtime_updates: bool = True) -> None:
        self.inner.configure(modules, runtime_updates)

    async def add(self, name: str, path: str) -> bool:
        return self.inner.add(name, path)

    async def remove(self, name: str) -> bool:
        return self.inner.remove(name)

    async def get(self, name: str) -> str | None:
        return self.inner.get(name)

    async def items(self) -> dict[str, str]:
        return self.inner.items()


class Engine:
    """The scheduler handle's LoRA commands, recorded; a load yields once so concurrent callers overlap."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.unreadable: set[str] = set()  # folders refused as LoRAManager refuses them, naming the folder
        self.reloading: set[str] = set()  # folders whose name's old adapter still serves requests (LoRARegistry)

    async def command(self, cmd: AddLoRA | RemoveLoRA) -> LoRAInfo | None:
        if isinstance(cmd, RemoveLoRA):
            self.calls.append(("remove", cmd.name))
            return None
        name, path = cmd.name, cmd.path
        await asyncio.sleep(0)
        self.calls.append(("add", f"{name}={path}"))
        if path in self.unreadable:
            raise InvalidParameterError("lora_path", f"adapter {path!r}: no such folder")
        if path in self.reloading:
            raise LoRAUnloadingError("lora_name", f"the adapter {name!r} is still being unloaded")
        return LoRAInfo(name=name, path=str(Path(path)), rank=8, targets=("q_proj",),
                        key=f"digest-{name}")  # as LoRAManager.add  # fmt: skip


def _replicas(runtime_updates: bool = True) -> tuple[LocalCatalog, list[Engine], list[ReplicaLoRAs]]:
    catalog = LocalCatalog()
    engines = [Engine(), Engine()]
    replicas = [ReplicaLoRAs(cast(SchedulerHandle, e), catalog, "base", runtime_updates=runtime_updates)
                for e in engines]  # fmt: skip
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
        assert two.loaded["a"] == "/adapters/a2"

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


def test_runtime_loading_and_unloading_are_off_unless_asked_for() -> None:
    async def run() -> None:
        catalog, engines, (one, _) = _replicas(runtime_updates=False)
        await catalog.configure({"a": "/adapters/a"})
        for call in (one.load("b", "/etc"), one.unload("a")):
            with pytest.raises(APIError) as err:
                await call
            assert err.value.status == 404 and "runtime_lora_updates" in str(err.value)
        assert engines[0].calls == [] and await catalog.items() == {"a": "/adapters/a"}
        assert await one.resolve("a") == "a"  # configured adapters are served all the same

    asyncio.run(run())


def test_a_configured_folder_that_fails_to_load_is_a_500_that_names_no_folder(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def run() -> None:
        catalog, engines, (one, _) = _replicas()
        await catalog.configure({"a": "/srv/secret/a"})
        engines[0].unreadable.add("/srv/secret/a")
        with pytest.raises(APIError) as err:
            await one.resolve("a")
        assert err.value.status == 500 and err.value.code == "lora_load_failed" and "'a'" in str(err.value)
        assert "/srv" not in str(err.value) and "a" not in one.loaded
        assert "/srv/secret/a" in caplog.text  # the operator still learns why
        engines[0].unreadable.clear()
        engines[0].reloading.add("/srv/secret/a")  # the name's old adapter still serves: retry, not a failure
        with pytest.raises(APIError) as err:
            await one.resolve("a")
        assert err.value.status == 503 and err.value.code == "lora_reloading" and "/srv" not in str(err.value)
        assert error_json(err.value).headers["retry-after"] == str(RETRY_AFTER_S)

    with caplog.at_level(logging.ERROR, logger="apps.replica.lora"):
        asyncio.run(run())


def test_spellings_of_one_folder_load_the_adapter_once() -> None:
    async def run() -> None:
        catalog, engines, (one, two) = _replicas()
        await one.load("a", "/adapters/./a/")
        for _ in range(3):
            assert await two.resolve("a") == "a"
        assert engines[1].calls == [("add", "a=/adapters/a")]
        assert lora_folder("./a") == os.path.join(os.getcwd(), "a") and lora_folder("/x/a/") == "/x/a"
        assert checked_modules({"b": "/x//b/"}) == {"b": "/x/b"}

    asyncio.run(run())


def test_a_redeploy_takes_new_folders_and_drops_modules_it_no_longer_lists() -> None:
    async def run() -> None:
        catalog, engines, (one, two) = _replicas()
        await catalog.configure({"a": "/f/a1", "b": "/f/b"})
        await one.load("c", "/f/c")  # loaded at run time: no deployment's to drop
        assert await two.resolve("a") == "a" and await two.resolve("b") == "b"
        await catalog.configure({"a": "/f/a1", "b": "/f/b"})  # another replica of the same deployment
        await catalog.configure({"a": "/f/a2"})  # the next deployment
        assert await catalog.items() == {"a": "/f/a2", "c": "/f/c"}
        assert await two.resolve("a") == "a"
        assert engines[1].calls[-2:] == [("remove", "a"), ("add", "a=/f/a2")]  # the new folder, not the old one
        with pytest.raises(APIError) as err:
            await two.resolve("b")
        assert err.value.status == 404 and engines[1].calls[-1] == ("remove", "b")
        # A deployment without runtime updates: what was loaded at run time goes too (nothing could unload it).
        await catalog.configure({"a": "/f/a2"}, runtime_updates=False)
        assert await catalog.items() == {"a": "/f/a2"}
        with pytest.raises(APIError) as err:
            await one.resolve("c")
        assert err.value.status == 404 and engines[0].calls[-1] == ("remove", "c")

    asyncio.run(run())
