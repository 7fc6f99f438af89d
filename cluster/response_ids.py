"""Response ids that name their replica, so a request about a stored response can be routed back to it.

``/v1/responses`` keeps finished responses in the replica that made them
(``apps.responses.service``). Each id is ``resp_<tag>-<hex>``, the tag being
the Serve replica's ``unique_id``: the router (``cluster.request_router``)
sends ``GET``/``DELETE /v1/responses/<id>`` and any request carrying
``X-Flotilla-Previous-Response: <id>`` (the SDK sends it with
``previous_response_id``; a plain client may add it) to that replica while it
is in the fleet. The header pins ``POST /v1/responses`` only: on any other
request it would let a client pin chat or completions traffic to one replica,
past the router's load bound, with no stored response to reach. A request that reaches another replica anyway is refused,
naming the replica that holds the id.
"""

from __future__ import annotations

import uuid

RESPONSE_ID_PREFIX = "resp_"
PREVIOUS_RESPONSE_HEADER = "X-Flotilla-Previous-Response"
RESPONSES_ENDPOINT = "/v1/responses"  # POST: a new response (maybe continuing a stored one)
RESPONSES_PATH = RESPONSES_ENDPOINT + "/"  # GET/DELETE of the stored response whose id follows
_TAG_END = "-"  # ends a response id's replica tag (a Serve unique_id holds letters and digits only)


def response_id(replica_tag: str) -> str:
    """A new response id naming the replica ``replica_tag``."""
    return f"{RESPONSE_ID_PREFIX}{replica_tag}{_TAG_END}{uuid.uuid4().hex}"


def replica_tag(rid: str) -> str | None:
    """The replica tag of a response id made by ``response_id``, else None."""
    if not rid.startswith(RESPONSE_ID_PREFIX) or _TAG_END not in rid:
        return None
    tag = rid[len(RESPONSE_ID_PREFIX):].split(_TAG_END, 1)[0]
    return tag or None
