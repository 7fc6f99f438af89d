"""The scheduler's side of the KV tiers (``kvcache.kv_tiers``): pages copied out, blocks loaded in.

Saving. When a request's computed pages join the radix tree, the ones a
``KVSaver`` picks (those no tier is known to hold) are queued to be copied
out. A queued page holds one allocator reference, so it cannot be handed out
again, nor overwritten, before the step that copies it has run; the next
step carries the queue (``Batch.kv_moves.saves``, up to ``MAX_SAVE_PAGES``; with
nothing else to run, a step carries only them), and ``saved`` drops the
references when the step is settled, whatever its outcome. More than
``MAX_QUEUED_SAVES`` pages queued (the tiers cannot keep up) drops the oldest:
the tiers are a cache, the pool is not.

Loading. A request whose prefix some tier may hold waits (``RequestKVMoves.loading``)
while the engine fetches it, at most the engine's ``load_wait_s``; the
blocks that arrived (``TierHit``) extend its radix match at admission: fresh
pages, written from the blocks before the step's forward (``Batch.kv_moves.imports``,
as prefilled KV is), and the request computes only what is left. Until that
step is settled the pages hold no KV yet (``kv_handoff``'s rule for imports).
"""

from __future__ import annotations

from typing import Protocol

from kvcache.kv_blocks import slice_pages
from kvcache.kv_transfer import RankPayloads
from kvcache.page_allocator import PageAllocator
from scheduling.request import Request

# Pages one step copies out at most (a burst of finished requests spreads over a few steps).
MAX_SAVE_PAGES = 256
# Queued pages beyond which the oldest are dropped unsaved (each pins a page of the pool).
MAX_QUEUED_SAVES = 1024


class KVSaver(Protocol):
    """Which newly cached pages go to the tiers (the engine's ``actors.engine.kv_tiers``)."""

    def select(self, namespace: str | None, token_ids: list[int], first_page: int,
               num_pages: int) -> list[tuple[int, bytes]]:  # fmt: skip
        """(page index in ``token_ids``' pages, block key) of each of pages
        ``[first_page, first_page + num_pages)`` to copy out."""


class SaveQueue:
    """Pages waiting to be copied out, each holding an allocator reference until its step is settled."""

    def __init__(self, allocator: PageAllocator) -> None:
        self.allocator = allocator
        self._queue: list[tuple[bytes, int]] = []  # (block key, page), oldest first
        self.num_dropped = 0

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, items: list[tuple[bytes, int]]) -> None:
        self.allocator.incref([page for _, page in items])
        self._queue += items
        excess = len(self._queue) - MAX_QUEUED_SAVES
        if excess > 0:
            dropped, self._queue = self._queue[:excess], self._queue[excess:]
            self.allocator.free([page for _, page in dropped])
            self.num_dropped += excess

    def take(self) -> tuple[list[int], list[bytes]]:
        """The pages (and keys) the next step copies out; their references stay until ``saved``."""
        items, self._queue = self._queue[:MAX_SAVE_PAGES], self._queue[MAX_SAVE_PAGES:]
        return [page for _, page in items], [key for key, _ in items]

    def saved(self, pages: list[int]) -> None:
        """The step that copied ``pages`` out is settled (ran or failed): drop their references."""
        self.allocator.free(pages)

    def clear(self) -> None:
        """The pool's contents were lost (the shards restarted): nothing queued is worth copying."""
        self.allocator.free([page for _, page in self._queue])
        self._queue = []


def tier_pages(req: Request, matched_pages: int, page_size: int) -> tuple[int, RankPayloads | None]:
    """How many pages of ``req.kv_moves.loaded`` extend a radix match of ``matched_pages``, and their payload.

    The blocks must start at or before the match's end (the tree may have
    lost pages since the lookup: then they do not join up) and leave at least
    one prompt token to compute (its logits are the first output).
    """
    hit = req.kv_moves.loaded
    if hit is None:
        return 0, None
    end = min(hit.first_page + hit.num_pages, (req.num_tokens - 1) // page_size)
    if hit.first_page > matched_pages or end <= matched_pages:
        return 0, None
    return end - matched_pages, slice_pages(hit.payload, matched_pages - hit.first_page, end - hit.first_page)
