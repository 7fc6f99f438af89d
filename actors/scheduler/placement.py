"""Where a replica's scheduler (engine loop and forward) runs: ``actor`` or ``replica``.

- ``actor`` (the default): each ``LLMServer`` replica creates its own
  ``SchedulerActor``; the replica submits and long-polls it over Ray.
- ``replica``: the scheduler runs inside the replica's process
  (``actors.scheduler.local``): no Ray call per request or per step, one
  process fewer per replica. Resources then go to the replica
  (``replica_options``), since there is no scheduler actor to give them to.

Light on purpose (no Ray, no torch): ``flotilla serve --help`` reads it.
"""

from __future__ import annotations

from typing import Any

from scheduling.errors import InvalidParameterError

SCHEDULER_PLACEMENTS = ("actor", "replica")
DEFAULT_PLACEMENT = "actor"


def check_placement(placement: str, scheduler_options: dict[str, Any] | None) -> None:
    """``placement`` is one of ``SCHEDULER_PLACEMENTS``; scheduler actor options need the actor."""
    if placement not in SCHEDULER_PLACEMENTS:
        raise InvalidParameterError("scheduler_placement",
                                    f"must be one of {list(SCHEDULER_PLACEMENTS)}, got {placement!r}")
    if placement == "replica" and scheduler_options:
        raise InvalidParameterError("scheduler_options", "sets the scheduler actor's Ray options, and "
                                    "scheduler_placement=replica runs no such actor; give the resources "
                                    "to the replica with replica_options")
