"""LoRA adapters across an application's replicas: one catalog of names, each replica loads on demand.

The OpenAI ``model`` field picks the adapter: the served model's name is the
base model, any other name must be in the application's catalog
(``LoRACatalog``: adapter name -> folder). The catalog is filled from
``lora_modules`` at start-up (every replica registers them; a deployment's
``lora_modules`` replace the previous deployment's, see ``LoRACatalog.configure``)
and, only with ``runtime_lora_updates``, by ``POST /v1/load_lora_adapter``.
Folders are kept normalised (``lora_folder``), so ``/x/a/`` and ``/x/a`` are
one adapter, loaded once.
A replica loads an adapter into its engine the first time a request for it
arrives there (the router prefers replicas that have it: see
``cluster.request_router``), so adding a replica costs no loads up front.

Every request for an adapter asks the catalog for its folder (one small
actor call), so the catalog alone decides what is served:
``POST /v1/unload_lora_adapter`` removes the name from the catalog, and from
then on a request for it is 404 on every replica. The receiving replica
unloads it from its engine, which finishes the requests already running on it
first (``actors.engine.lora_registry``); another replica unloads it on the
next request that names it, or at its next ``sync`` (Serve's health check,
every 10 s). A name registered again with another folder is reloaded from
the new folder.

The catalog is a detached named Ray actor per Serve application, so it
outlives any one replica (a replica restarted by Serve finds it); it stays
after ``serve delete`` and is reused by the next deployment of that name.
Adapter folders must be readable at the same path on every node.

Runtime loading and unloading are admin operations: off unless the app is
started with ``runtime_lora_updates`` (``flotilla serve
--runtime-lora-updates``), and then behind the API key when keys are set.
Off, both endpoints answer 404, as a server without them would (vLLM
registers them only with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``): the server
has no such operation, and no credential opens it, which a 403 would suggest.
The message names the option an operator sets. No answer carries a server
folder (``/v1/models`` lists names).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Protocol, cast

import ray
from ray.actor import ActorHandle

from actors.api import LoRAInfo
from actors.commands import AddLoRA, RemoveLoRA
from actors.errors import LoRAUnloadingError
from actors.scheduler.handle import SchedulerHandle
from apps.inputs.params import unknown_model
from apps.protocol.errors import APIError, unwrapped
from scheduling.errors import InvalidParameterError
from scheduling.sampling_params import check_lora_name

CATALOG_NAMESPACE = "flotilla"
CATALOG_TIMEOUT_S = 60.0  # a replica's start waits this long for the catalog actor (it may be placed first)

logger = logging.getLogger(__name__)


def lora_folder(path: str) -> str:
    """``path`` absolute and normalised (``/x/a/``, ``/x/./a`` -> ``/x/a``; relative to this process's cwd).

    The catalog and each replica compare folders as strings: one spelling per
    folder keeps an adapter from being reloaded on every request.
    """
    return os.path.abspath(path)


class LoRACatalog:
    """Adapter name -> folder, for one application (run as a detached Ray actor)."""

    def __init__(self) -> None:
        self.paths: dict[str, str] = {}
        self.configured: dict[str, str] = {}  # the lora_modules of the latest deployment

    def configure(self, modules: dict[str, str], runtime_updates: bool) -> None:
        """Make ``modules`` (a deployment's ``lora_modules``) the configured adapters.

        The catalog outlives the app, so a redeploy meets the previous
        deployment's entries: a name it configured that ``modules`` lacks is
        dropped (unless loaded at run time since with another folder), and
        every name of ``modules`` points at its folder, replacing what the
        name held. Adapters loaded at run time stay only while the new
        deployment has ``runtime_updates`` too: without it nothing could
        unload them, and the catalog would serve what no configuration names.
        Idempotent: every replica of a deployment calls it.
        """
        if not runtime_updates:
            self.paths = {}
        for name, path in self.configured.items():
            if name not in modules and self.paths.get(name) == path:
                del self.paths[name]
        self.paths.update(modules)
        self.configured = dict(modules)

    def add(self, name: str, path: str) -> bool:
        """Register ``name``; False (and nothing changes) if it is registered with another folder."""
        known = self.paths.get(name)
        if known is not None and known != path:
            return False
        self.paths[name] = path
        return True

    def remove(self, name: str) -> bool:
        return self.paths.pop(name, None) is not None

    def get(self, name: str) -> str | None:
        return self.paths.get(name)

    def items(self) -> dict[str, str]:
        return dict(self.paths)


_RemoteCatalog = ray.remote(LoRACatalog)


class CatalogHandle(Protocol):
    """What a replica calls on its catalog (the Ray actor, or an in-process one in tests)."""

    def configure(self, modules: dict[str, str], runtime_updates: bool) -> Awaitable[None]: ...

    def add(self, name: str, path: str) -> Awaitable[bool]: ...

    def remove(self, name: str) -> Awaitable[bool]: ...

    def get(self, name: str) -> Awaitable[str | None]: ...

    def items(self) -> Awaitable[dict[str, str]]: ...


class ActorCatalog:
    """The application's catalog actor as a ``CatalogHandle`` (created by the first replica that asks)."""

    def __init__(self, app_name: str) -> None:
        # ray.remote's stubs type the handle as a union with the class itself.
        self.actor = cast(ActorHandle, _RemoteCatalog.options(
            name=f"lora-catalog:{app_name}", namespace=CATALOG_NAMESPACE, lifetime="detached",
            get_if_exists=True, num_cpus=0,
        ).remote())  # fmt: skip

    def configure(self, modules: dict[str, str], runtime_updates: bool) -> Awaitable[None]:
        return self.actor.configure.remote(modules, runtime_updates)

    def add(self, name: str, path: str) -> Awaitable[bool]:
        return self.actor.add.remote(name, path)

    def remove(self, name: str) -> Awaitable[bool]:
        return self.actor.remove.remote(name)

    def get(self, name: str) -> Awaitable[str | None]:
        return self.actor.get.remote(name)

    def items(self) -> Awaitable[dict[str, str]]:
        return self.actor.items.remote()

    def register_now(self, modules: dict[str, str], runtime_updates: bool) -> None:
        """Make ``lora_modules`` the catalog's configured adapters, waiting (a replica's constructor is synchronous;
        bounded: a catalog that does not answer fails the replica's start, which Serve retries)."""
        ray.get(self.actor.configure.remote(checked_modules(modules), runtime_updates), timeout=CATALOG_TIMEOUT_S)


def checked_modules(modules: dict[str, str]) -> dict[str, str]:
    """``lora_modules`` with each name checked and each folder normalised; a bad entry names ``lora_modules``."""
    out: dict[str, str] = {}
    for name, path in modules.items():
        check_lora_name(name, "lora_modules")
        if not isinstance(path, str) or not path:
            raise InvalidParameterError("lora_modules", f"adapter {name!r}: the folder must be a path")
        out[name] = lora_folder(path)
    return out


class ReplicaLoRAs:
    """One replica's view: which adapters its engine has, loading them from the catalog on demand."""

    def __init__(self, scheduler: SchedulerHandle, catalog: CatalogHandle | None, base_name: str,
                 record: Callable[[str, float], None] | None = None, *, runtime_updates: bool = False) -> None:
        self.scheduler = scheduler
        self._record = record or (lambda name, value: None)  # metrics: lora_resident_hits / lora_loads
        self.catalog = catalog  # None: the engine runs without LoRA
        self.base_name = base_name
        self.runtime_updates = runtime_updates  # POST /v1/load_lora_adapter and unload are open
        self.loaded: dict[str, str] = {}  # adapter -> the (normalised) folder this engine loaded it from
        self._loading: dict[str, asyncio.Lock] = {}

    async def resolve(self, model: str | None) -> str | None:
        """The adapter ``model`` names (None for the base model), loaded here first if needed; 404 if unknown."""
        if model is None or model == self.base_name:
            return None
        path = await self._path(model)
        lock = self._loading.setdefault(model, asyncio.Lock())
        async with lock:  # concurrent first requests load it once
            held = self.loaded.get(model)
            if held == path:
                self._record("lora_resident_hits", 1)
                return model
            if held is not None:  # registered again (or redeployed) with another folder
                await self._unload_here(model)
            try:
                await self.scheduler.command(AddLoRA(model, path))
            except Exception as e:  # every refusal names the operator's folder: logged, not answered
                cause = unwrapped(e)
                if isinstance(cause, APIError):
                    raise cause from None
                if isinstance(cause, LoRAUnloadingError):  # the old folder's requests still run: soon, not never
                    raise APIError(503, f"adapter {model!r} is being reloaded from its new folder; retry shortly",
                                   code="lora_reloading") from None  # fmt: skip
                logger.error("LoRA adapter %r from the catalog could not be loaded: %r", model, cause)
                raise APIError(500, f"adapter {model!r} could not be loaded on this replica (the server's log "
                                    "says why)", code="lora_load_failed") from None  # fmt: skip
            self.loaded[model] = path
            self._record("lora_loads", 1)
        return model

    async def check_known(self, model: str | None) -> None:
        """404 unless ``model`` is the base model or an adapter of the catalog (nothing is loaded)."""
        if model is not None and model != self.base_name:
            await self._path(model)

    async def _path(self, model: str) -> str:
        """The folder the catalog holds for ``model``; 404 (and unloaded here) if it holds none."""
        path = await self.catalog.get(model) if self.catalog is not None else None
        if path is None:
            await self._unload_here(model)  # unloaded through another replica
            raise unknown_model(model)
        return path

    async def load(self, name: str, path: str) -> LoRAInfo:
        """``POST /v1/load_lora_adapter``: checked by loading it here, then registered app-wide."""
        self.check_runtime_updates()
        check_lora_name(name, "lora_name")
        catalog = self._catalog()
        if name == self.base_name or name in await catalog.items():
            raise InvalidParameterError("lora_name", f"the name {name!r} is already in use")
        path = lora_folder(path)
        info = await self.scheduler.command(AddLoRA(name, path))
        self.loaded[name] = path
        if not await catalog.add(name, path):  # another replica registered it meanwhile
            await self._unload_here(name)
            raise InvalidParameterError("lora_name", f"the name {name!r} is already in use")
        return info

    async def unload(self, name: str) -> None:
        """``POST /v1/unload_lora_adapter``: out of the catalog now, out of this engine once its requests end."""
        self.check_runtime_updates()
        if not await self._catalog().remove(name):
            raise APIError(404, f"no adapter named {name!r} is loaded", param="lora_name", code="model_not_found")
        await self._unload_here(name)

    async def sync(self) -> None:
        """Drop what the catalog no longer lists (unloaded through another replica)."""
        if self.catalog is None or not self.loaded:
            return
        listed = await self.catalog.items()
        for name in [n for n in self.loaded if n not in listed]:
            await self._unload_here(name)

    async def names(self) -> list[str]:
        """Every adapter of the application, sorted (never their folders: they are the server's)."""
        return [] if self.catalog is None else sorted(await self.catalog.items())

    async def _unload_here(self, name: str) -> None:
        if self.loaded.pop(name, None) is not None:
            await self.scheduler.command(RemoveLoRA(name))

    def check_runtime_updates(self) -> None:
        """404 unless the application was started with ``runtime_lora_updates`` (see the module docstring)."""
        if not self.runtime_updates:
            raise APIError(404, "loading and unloading adapters at run time is off: start the application "
                                "with runtime_lora_updates (flotilla serve --runtime-lora-updates)")  # fmt: skip

    def _catalog(self) -> CatalogHandle:
        if self.catalog is None:
            raise InvalidParameterError("enable_lora", "this application serves no LoRA adapters "
                                                       "(start it with enable_lora or lora_modules)")  # fmt: skip
        return self.catalog
