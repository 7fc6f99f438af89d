"""The per-replica store of finished Responses: bounded by count and by bytes, each entry owned by its API key.

``ResponseStore`` keeps the responses a replica made for ``previous_response_id``
and ``GET``/``DELETE /v1/responses/{id}``, in memory; least recently used go
first once either bound is passed. A response id carries its replica's tag,
so a request for an id another replica holds is told so (and the router sends
requests naming an id to its replica: ``cluster.request_router``).

Bytes are measured, not guessed: an entry's ``size`` is what ``sys.getsizeof``
finds reachable from its response object and its turns (strings, dicts, lists,
pydantic models; each object once), which is several times the JSON it came
from. A chain shares its parents (``StoredResponse.parent``), and a parent
evicted from the store stays alive while a stored child reaches it, so the
byte count is of every response *held*: stored, or an ancestor of a stored
one. Each is counted once however many stored entries reach it.

Ownership: an entry records the key that made it (``apps.inputs.auth.KeyOwner``;
``None`` when the server has no keys). Another key finds nothing: ``get`` and
``delete`` answer as for an id never stored, so a 404 does not tell a caller
that someone else's response exists.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from apps.inputs.auth import KeyOwner
from apps.protocol.models import ChatMessage
from scheduling.errors import InvalidParameterError

DEFAULT_MAX_STORED_RESPONSES = 1024  # per replica
DEFAULT_MAX_STORED_RESPONSE_BYTES = 256 * 1024 * 1024  # per replica: what the held responses take in memory


def held_bytes(*roots: object) -> int:
    """The bytes of every object reachable from ``roots`` through dicts, lists, tuples, sets and pydantic
    models, each counted once (an upper bound: interned strings shared with others count too)."""
    seen: set[int] = set()
    total = 0
    stack: list[object] = list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        if isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif isinstance(obj, BaseModel):
            stack.append(obj.__dict__)  # a model's field values live in its __dict__
    return total


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """A finished response: its own turns (its input and its output, without instructions) after its parent's.

    Holding the parent (the ``previous_response_id`` it continued) rather than a
    copy of its turns keeps a chain of N responses at O(N) turns, not O(N^2);
    a parent evicted from the store stays reachable from its children.
    ``size``: the bytes this entry holds itself (not its parent's).
    """

    response: dict[str, Any]
    turns: list[ChatMessage]
    parent: StoredResponse | None = None
    owner: KeyOwner = None
    size: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "size", held_bytes(self.response, self.turns))  # frozen: set once, here

    @property
    def id(self) -> str:
        return str(self.response["id"])

    def chain(self) -> list[StoredResponse]:
        """This response and its ancestors, newest first."""
        out: list[StoredResponse] = []
        entry: StoredResponse | None = self
        while entry is not None:
            out.append(entry)
            entry = entry.parent
        return out

    def conversation(self) -> list[ChatMessage]:
        """Every turn from the first response of the chain to this one's output."""
        return [turn for one in reversed(self.chain()) for turn in one.turns]


class ResponseStore:
    """A replica's finished responses by id: at most ``max_entries`` stored and ``max_bytes`` held (least
    recently used go first; a response larger than ``max_bytes`` on its own is not kept)."""

    def __init__(self, max_entries: int = DEFAULT_MAX_STORED_RESPONSES,
                 max_bytes: int = DEFAULT_MAX_STORED_RESPONSE_BYTES) -> None:
        for name, value in (("max_stored_responses", max_entries), ("max_stored_response_bytes", max_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidParameterError(name, f"must be an integer >= 1, got {value!r}")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        # Every response held (stored, or an ancestor of a stored one) -> how many stored entries reach it.
        self._reach: dict[str, int] = {}
        self.num_bytes = 0  # the sizes of the responses in _reach, each once

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, entry: StoredResponse) -> None:
        """Keep ``entry`` (the most recently used now), then evict the least recently used past either bound."""
        self._drop(entry.id)
        self._entries[entry.id] = entry
        for one in entry.chain():
            self._reach[one.id] = self._reach.get(one.id, 0) + 1
            if self._reach[one.id] == 1:
                self.num_bytes += one.size
        while self._entries and (len(self._entries) > self.max_entries or self.num_bytes > self.max_bytes):
            self._drop(next(iter(self._entries)))

    def get(self, rid: str, owner: KeyOwner) -> StoredResponse | None:
        """The entry ``rid`` if ``owner`` made it (then it is the most recently used), else None."""
        entry = self._entries.get(rid)
        if entry is None or entry.owner != owner:  # owners are key digests: comparing them reveals no key
            return None
        self._entries.move_to_end(rid)
        return entry

    def delete(self, rid: str, owner: KeyOwner) -> bool:
        """Forget ``rid`` if ``owner`` made it; whether it did."""
        if self.get(rid, owner) is None:
            return False
        self._drop(rid)
        return True

    def _drop(self, rid: str) -> None:
        entry = self._entries.pop(rid, None)
        if entry is None:
            return
        for one in entry.chain():
            self._reach[one.id] -= 1
            if self._reach[one.id] == 0:
                del self._reach[one.id]
                self.num_bytes -= one.size
