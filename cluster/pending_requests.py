"""What a request router reads from one pending request: a routing key, a model, a stored response's owner.

What the router can see (checked against ray 2.60.0: ``proxy.py``,
``proxy_request_response.py``, ``common.StreamingHTTPRequest``): for an HTTP
ingress deployment ``pending_request.args[0]`` is the pickled
``StreamingHTTPRequest``, which carries the ASGI *scope* (path, headers) and
not the body: the replica pulls the body from the proxy after routing. So:

- ``X-Flotilla-Prefix: <text>``: the client names the shared part of its
  prompt (a system prompt, a document, or any stable label of it); matched as
  text, longest prefix wins. ``bench autoscale --mode routing`` sends it.
- ``X-Flotilla-Session: <id>`` (what the SDK sends): the whole session sticks
  to one replica, within the same load-balance bound.
- A ``DeploymentHandle`` caller that passes the request body (a dict with
  ``prompt`` or ``messages``, or a string) is routed on the prompt text itself.
- Anything else: power of two choices, like Serve's default router.

The router (``cluster.request_router``) decodes a request once
(``RequestArg.of``) and reads each of these from it.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from cluster.response_ids import (
    PREVIOUS_RESPONSE_HEADER,
    RESPONSES_ENDPOINT,
    RESPONSES_PATH,
    replica_tag,
)

PREFIX_HEADER = b"x-flotilla-prefix"
SESSION_HEADER = b"x-flotilla-session"
MODEL_HEADER = b"x-flotilla-model"
# What a cluster's environment needs for HAProxy to show the router (cluster.ingress_router) what it routes on:
# the body, and the session header (``cli.ingress`` sets it; Serve reads it at import, in its controller).
ROUTER_ENVIRONMENT = {"RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY": "1",
                      "RAY_SERVE_SESSION_ID_HEADER_KEY": SESSION_HEADER.decode()}


@dataclass(frozen=True, slots=True)
class RoutingKey:
    """What a request is routed on: prompt text (prefix match) or a session id (exact)."""

    kind: Literal["prompt", "session"]
    text: str


def _prompt_text(body: Mapping[str, Any]) -> str | None:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    messages = body.get("messages")
    if isinstance(messages, list):
        parts = [f"{m.get('role', '')}:{m.get('content', '')}" for m in messages if isinstance(m, Mapping)]
        return "\n".join(parts) if parts else None
    return None


def _scope(arg: Any) -> Mapping[str, Any] | None:
    """The ASGI scope of a proxied HTTP request (pickled or not), else None."""
    if isinstance(arg, bytes | bytearray):
        try:
            arg = pickle.loads(arg)  # noqa: S301 - Serve's own proxy-to-replica message
        except Exception:
            return None
    scope = getattr(arg, "asgi_scope", None)
    return scope if isinstance(scope, Mapping) else None


def key_from_headers(headers: Sequence[tuple[bytes, bytes]]) -> RoutingKey | None:
    """The routing key named by ``X-Flotilla-Prefix`` (preferred) or ``X-Flotilla-Session``."""
    found = {name.lower(): value for name, value in headers if name.lower() in (PREFIX_HEADER, SESSION_HEADER)}
    if found.get(PREFIX_HEADER):
        return RoutingKey("prompt", found[PREFIX_HEADER].decode("utf-8", errors="replace"))
    if found.get(SESSION_HEADER):
        return RoutingKey("session", hashlib.sha256(found[SESSION_HEADER]).hexdigest())
    return None


@dataclass(frozen=True, slots=True)
class RequestArg:
    """A pending request's first argument and, for a proxied HTTP request, its ASGI scope: unpickled once
    per routing decision, however many things (key, model, response owner) are read from it."""

    value: Any
    scope: Mapping[str, Any] | None

    @classmethod
    def of(cls, args: Sequence[Any], kwargs: Mapping[str, Any]) -> RequestArg:
        first = args[0] if args else kwargs.get("request", kwargs.get("body"))
        if isinstance(first, RequestArg):  # already decoded: what the ingress router passes (cluster.ingress_router)
            return first
        return cls(first, None if isinstance(first, str | Mapping) else _scope(first))

    def header(self, wanted: bytes) -> bytes | None:
        """The value of header ``wanted`` (lower case), if present and non-empty."""
        for name, value in (self.scope or {}).get("headers") or []:
            if name.lower() == wanted and value:
                return bytes(value)
        return None


def routing_key(args: Sequence[Any], kwargs: Mapping[str, Any]) -> RoutingKey | None:
    """The key of a pending request's arguments (see the module docstring), or None."""
    return request_key(RequestArg.of(args, kwargs))


def response_owner(args: Sequence[Any], kwargs: Mapping[str, Any]) -> str | None:
    """The replica tag of the stored response a pending HTTP request is about (``cluster.response_ids``):
    the id in a ``/v1/responses/<id>`` path, else, for ``POST /v1/responses`` only, in
    ``X-Flotilla-Previous-Response``; None if neither."""
    return request_owner(RequestArg.of(args, kwargs))


def requested_model(args: Sequence[Any], kwargs: Mapping[str, Any]) -> str | None:
    """The model (maybe a LoRA adapter) a pending request names, or None."""
    return request_model(RequestArg.of(args, kwargs))


def request_key(arg: RequestArg) -> RoutingKey | None:
    """``routing_key`` of an already decoded argument: a header's key first (what the client named), else
    the prompt of a body the router can read."""
    if arg.scope is not None:
        key = key_from_headers(arg.scope.get("headers") or [])
        if key is not None:
            return key
    if isinstance(arg.value, str):
        return RoutingKey("prompt", arg.value)
    if isinstance(arg.value, Mapping):
        text = _prompt_text(arg.value)
        return RoutingKey("prompt", text) if text else None
    return None


def request_owner(arg: RequestArg) -> str | None:
    """``response_owner`` of an already decoded argument (a body's ``previous_response_id`` too, where
    the router reads bodies: ``cluster.ingress_router``)."""
    if isinstance(arg.value, Mapping):
        previous = arg.value.get("previous_response_id")
        if isinstance(previous, str) and previous:
            return replica_tag(previous)
    if arg.scope is None:
        return None
    path = arg.scope.get("path")
    if not isinstance(path, str):
        return None
    if RESPONSES_PATH in path:  # the app's route prefix may come first
        return replica_tag(path.rpartition(RESPONSES_PATH)[2])
    if not path.rstrip("/").endswith(RESPONSES_ENDPOINT):  # the header pins Responses requests only
        return None
    rid = arg.header(PREVIOUS_RESPONSE_HEADER.lower().encode())
    return None if rid is None else replica_tag(rid.decode("utf-8", errors="replace"))


def request_model(arg: RequestArg) -> str | None:
    """``requested_model`` of an already decoded argument."""
    if isinstance(arg.value, Mapping):
        model = arg.value.get("model")
        return model if isinstance(model, str) and model else None
    value = arg.header(MODEL_HEADER)
    return None if value is None else value.decode("utf-8", errors="replace")
