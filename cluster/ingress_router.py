"""``IngressRouter``: prefix-aware routing for HAProxy's direct ingress, one routing call per request.

With direct ingress (``flotilla serve``'s default, ``cli.ingress``) each
``LLMServer`` replica serves HTTP on its own port and HAProxy streams a
response straight from it to the client: no Ray call per chunk. Before it
forwards a ``POST``, HAProxy's Lua action (Ray 2.60's
``ingress_request_router.lua.tmpl``) posts the request's body to this
deployment's ``/internal/route`` and sends the request to the replica named in
the answer. So routing stays Ray's: the answer comes from
``DeploymentHandle.choose_replica`` on the ``LLMServer`` deployment, that is
from its ``PrefixAwareRequestRouter`` (``cluster.request_router``), which here
sees the request's body, not only its headers as behind Serve's proxy: a
prompt is matched on its own text, an adapter on the body's ``model``, a
Responses request on its ``previous_response_id``, and ``X-Flotilla-Session``
(the header HAProxy forwards: ``cluster.pending_requests.ROUTER_ENVIRONMENT``) pins a whole session.

What HAProxy forwards (checked against ray 2.60.0): the body when
``RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY=1`` (cut at HAProxy's
``tune.bufsize``, then ``X-Body-Truncated`` says so), the one session header
``RAY_SERVE_SESSION_ID_HEADER_KEY`` names, and ``X-Request-Id``. Only
``POST`` requests are routed; other methods are balanced by HAProxy itself
(least connections). A non-200 answer makes HAProxy answer 503.

The pick is made without reserving a slot on the replica (``_reserve=False``,
as Ray's own LLM router does): the request itself goes through HAProxy, and
the replica answers an excess with 429 (``apps.replica.requests``). This
module imports no engine (no torch): its replica starts in about a second.

No ``from __future__ import annotations`` here: FastAPI reads the route
methods' annotations at runtime (a string ``Request`` became a body field).
"""

import json
from collections.abc import Mapping
from typing import Any, cast

from fastapi import FastAPI, HTTPException, Request
from ray import serve
from ray.serve import Deployment
from ray.serve._private.constants import RAY_SERVE_ENABLE_HA_PROXY
from ray.serve.exceptions import DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle

from cluster.pending_requests import SESSION_HEADER, RequestArg

ROUTE_PATH = "/internal/route"  # fixed by Ray's Lua action
# Answers HAProxy waits for concurrently; well above any replica's max_ongoing_requests so the router
# never queues the hot path (a pick takes tens of microseconds of this process's time).
MAX_ONGOING_ROUTES = 4096

router_api = FastAPI()


def routed_request(body: bytes, session: str | None) -> RequestArg:
    """What the request router reads from a forwarded request: its JSON body (an empty mapping when the
    body is not a JSON object, or was cut short) and the session header."""
    value: Mapping[str, Any] = {}
    try:
        parsed = json.loads(body) if body else None
    except ValueError:  # cut at HAProxy's buffer, or not JSON: the replica answers it, routed on load alone
        parsed = None
    if isinstance(parsed, Mapping):
        value = parsed
    headers = [(SESSION_HEADER, session.encode())] if session else []
    return RequestArg(value, {"headers": headers})


@serve.ingress(router_api)
class IngressRouter:
    """Answers HAProxy's ``/internal/route`` with the ``LLMServer`` replica the request router picks."""

    def __init__(self, server: DeploymentHandle) -> None:
        self._server = server

    @router_api.post(ROUTE_PATH)
    async def route(self, request: Request) -> dict[str, Any]:
        """``{"host", "port", "replica_id"}`` of the pick; 503 while no replica serves HTTP."""
        arg = routed_request(await request.body(), request.headers.get(SESSION_HEADER.decode()))
        try:
            async with self._server.choose_replica(arg, _reserve=False) as selection:
                # Ray 2.60's ReplicaSelection holds the RunningReplica that knows its HTTP endpoint and the
                # full id HAProxy's server map is keyed on (the same attribute Ray's LLM router reads).
                replica = selection._replica
        except DeploymentUnavailableError as exc:
            raise HTTPException(503, str(exc)) from exc
        endpoint = replica.backend_http_endpoint
        if endpoint is None:
            raise HTTPException(503, f"replica {selection.replica_id} serves no HTTP")
        host, port = endpoint
        return {"host": host, "port": port, "replica_id": replica.replica_id.to_full_id_str()}

    @router_api.get("/health")
    async def health(self) -> dict[str, str]:
        return {"status": "ok"}


def direct_ingress() -> bool:
    """Whether this process builds for HAProxy's direct ingress: Serve read ``RAY_SERVE_ENABLE_HA_PROXY``
    from this process's environment at import, as its own ``build_app`` does (the cluster's environment,
    for ``serve deploy``)."""
    return bool(RAY_SERVE_ENABLE_HA_PROXY)


def ingress_router_deployment() -> Deployment:
    """The router's deployment: no CPU reserved (it shares a node's cores like Serve's proxy), many routes at
    once."""
    deployment = serve.deployment(IngressRouter, name="IngressRouter", max_ongoing_requests=MAX_ONGOING_ROUTES,
                                  ray_actor_options={"num_cpus": 0})
    return cast(Deployment, deployment)
