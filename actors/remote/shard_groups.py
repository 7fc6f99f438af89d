"""Names the shards' placement groups after their creator, and reaps those whose creator died.

Ray removes a placement group only when its creator actor AND its creator job
are both dead. A replica's SchedulerActor creates the group of its shards; when
that actor dies (a crash, ``ray.kill``, its replica killed) the job (Serve's)
lives on, so the group would hold its CPUs/GPUs until the cluster stops and the
replacement replica could not place its shards. Each group is named
``flotilla-shards-<creator actor id>-<nonce>``; before placing a new group,
``reap_orphans`` removes every such group whose creator actor is dead.
"""

from __future__ import annotations

import uuid

import ray
from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group

PREFIX = "flotilla-shards-"


def group_name() -> str:
    """A unique name that records the creating actor (``driver`` outside an actor)."""
    creator = ray.get_runtime_context().get_actor_id() or "driver"
    return f"{PREFIX}{creator}-{uuid.uuid4().hex[:8]}"


def _creator_dead(actor_id: str) -> bool:
    from ray._private.state import actors  # GCS's actor table: works without the dashboard

    info = actors(actor_id=actor_id)
    return bool(info) and info.get("State") == "DEAD"


def reap_orphans() -> int:
    """Remove the shard groups of dead creators; returns how many were removed."""
    removed = 0
    for group_id, info in placement_group_table().items():
        name = str(info.get("name") or "")
        if not name.startswith(PREFIX) or info.get("state") == "REMOVED":
            continue
        creator = name[len(PREFIX):].rsplit("-", 1)[0]
        if creator != "driver" and _creator_dead(creator):
            remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(group_id))))
            removed += 1
    return removed
