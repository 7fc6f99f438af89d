"""Adapter admin through the replica's route handlers, without Ray: closed by default, keyed when open.

The handlers of ``LLMServer`` run on an object that holds only what they
read (``auth``, ``loras``, ...) over the stand-in engine and in-process
catalog of ``test_lora_serving``. Off (the default), both admin endpoints
answer 404 before reading the body, as a server without them would; open
with API keys set, they answer 401 without a key; ``/v1/models`` and the
load answer carry adapter names, never the server's folders.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any, cast

from starlette.requests import Request
from starlette.responses import Response

from actors.config import EngineConfig
from actors.scheduler.handle import SchedulerHandle
from apps.inputs.auth import ApiKeyAuth
from apps.replica.lora import ReplicaLoRAs
from apps.replica.server import LLMServer
from tests.apps.replica.test_lora_serving import Engine, LocalCatalog

KEY = "admin-key"
FOLDER = "/srv/secret/adapters/a"


def _server(*, runtime_updates: bool, keys: list[str]) -> tuple[SimpleNamespace, Engine, LocalCatalog]:
    engine, catalog = Engine(), LocalCatalog()
    server = SimpleNamespace(  # what the handlers read: no replica is built
        auth=ApiKeyAuth(keys), model_name="base", created=0, max_body_bytes=1 << 20,
        loras=ReplicaLoRAs(cast(SchedulerHandle, engine), catalog, "base", runtime_updates=runtime_updates),
        config=EngineConfig.from_kwargs(model="tiny", max_model_len=64),
    )  # fmt: skip
    return server, engine, catalog


def _request(path: str, body: dict[str, str] | None, key: str | None) -> Request:
    payload = json.dumps(body).encode() if body is not None else b""
    headers = [(b"content-type", b"application/json")]
    if key is not None:
        headers.append((b"authorization", f"Bearer {key}".encode()))
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        assert not sent, "the body was read twice"
        sent = True
        return {"type": "http.request", "body": payload, "more_body": False}

    scope = {"type": "http", "method": "POST" if body is not None else "GET", "path": path, "headers": headers,
             "query_string": b""}  # fmt: skip
    return Request(scope, receive)


def _call(server: SimpleNamespace, route: str, path: str, body: dict[str, str] | None, key: str | None = None
          ) -> tuple[int, dict[str, Any]]:  # fmt: skip
    handler = getattr(LLMServer.func_or_class, route)  # the undecorated class's method
    response = cast(Response, asyncio.run(handler(server, _request(path, body, key))))
    return response.status_code, json.loads(bytes(response.body))


def test_admin_endpoints_are_404_when_runtime_updates_are_off() -> None:
    server, engine, catalog = _server(runtime_updates=False, keys=[])
    catalog.inner.configure({"a": FOLDER}, False)
    status, body = _call(server, "load_lora_adapter", "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": "/"})
    assert status == 404 and "runtime_lora_updates" in body["error"]["message"], body
    status, body = _call(server, "unload_lora_adapter", "/v1/unload_lora_adapter", {"lora_name": "a"})
    assert status == 404, body
    assert engine.calls == [] and catalog.inner.items() == {"a": FOLDER}


def test_open_admin_needs_the_key_when_keys_are_set() -> None:
    server, engine, catalog = _server(runtime_updates=True, keys=[KEY])
    load = {"lora_name": "b", "lora_path": FOLDER}
    for key in (None, "wrong"):
        status, body = _call(server, "load_lora_adapter", "/v1/load_lora_adapter", load, key)
        assert status == 401 and body["error"]["code"] == "invalid_api_key", body
        status, body = _call(server, "unload_lora_adapter", "/v1/unload_lora_adapter", {"lora_name": "b"}, key)
        assert status == 401, body
    assert engine.calls == []
    status, body = _call(server, "load_lora_adapter", "/v1/load_lora_adapter", load, KEY)
    assert status == 200 and body["id"] == "b" and FOLDER not in json.dumps(body), body
    status, body = _call(server, "unload_lora_adapter", "/v1/unload_lora_adapter", {"lora_name": "b"}, KEY)
    assert status == 200 and body["deleted"] is True


def test_models_list_adapters_without_their_folders() -> None:
    server, _, catalog = _server(runtime_updates=False, keys=[])
    catalog.inner.configure({"a": FOLDER, "b": "/srv/other"}, False)
    status, body = _call(server, "models", "/v1/models", None)
    assert status == 200 and [c["id"] for c in body["data"]] == ["base", "a", "b"]
    assert all(c.get("parent") == "base" for c in body["data"][1:])
    assert "/srv" not in json.dumps(body), body
