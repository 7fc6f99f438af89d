"""``GET``/``DELETE /v1/responses/{id}`` on a replica that does not hold the id: asked of the one that does.

Behind HAProxy (the default ingress) only ``POST`` requests are routed
(``cluster.ingress_router``); HAProxy balances a ``GET`` or ``DELETE`` to any
replica. The replica it reaches, if the id names another
(``cluster.response_ids``), calls ``LLMServer.stored_response`` through a
handle to its own deployment with the id as its routed argument, and the
prefix router pins that call to the holder (``request_owner``), as it pins
the request itself behind Serve's proxy. The holder checks the caller's key
as it would over HTTP. A holder that has left the fleet cannot be reached:
the call lands elsewhere and answers the 404 that names the holder; the
callee never forwards again, so a call crosses at most one hop.
"""

from __future__ import annotations

import functools
from typing import Any, Literal

from ray import serve
from ray.serve.handle import DeploymentHandle

from cluster.pending_requests import RequestArg
from cluster.response_ids import replica_tag

StoredResponseMethod = Literal["GET", "DELETE"]
STORED_RESPONSE_CALL = "stored_response"  # the LLMServer method the holder answers on


def holder_arg(rid: str) -> RequestArg:
    """The routed argument of a call about ``rid``: the router sends it to the replica holding ``rid``."""
    return RequestArg({"previous_response_id": rid}, None)


async def at_holder(rid: str, this_tag: str, method: StoredResponseMethod,
                    authorization: str | None) -> tuple[int, dict[str, Any]] | None:
    """The holder's ``(status, JSON body)`` for ``method`` on ``rid``; None when ``rid`` is this replica's
    (or names none): answer it here."""
    holder = replica_tag(rid)
    if holder is None or holder == this_tag:
        return None
    result: tuple[int, dict[str, Any]] = await _holders().remote(holder_arg(rid), method, authorization)
    return result


@functools.cache
def _holders() -> DeploymentHandle:
    """This replica's handle to its own deployment's ``stored_response``: made once, so its router (and the
    replica set it follows) is not built again for every forwarded request."""
    context = serve.get_replica_context()
    return serve.get_deployment_handle(context.deployment, context.app_name).options(
        method_name=STORED_RESPONSE_CALL)
