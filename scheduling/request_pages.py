"""A request's KV pages: reserved as it grows, started from a cached prefix, released into the cache.

Page ownership: a request holds one allocator reference on every page in its
page table, matched prefix pages included, and a lock on the radix node it
matched. When it ends (finish, abort or preemption) its fully computed pages
go into the radix tree, which takes its own references, and the request drops
all of its own. An embedding request's pages (``Request.pooling``) never go
into the tree: they are freed outright.
"""

from __future__ import annotations

from kvcache.page_allocator import PageAllocator
from kvcache.radix_cache import PrefixMatch, RadixCache
from scheduling.kv_tiers import KVSaver, SaveQueue
from scheduling.request import Request


class RequestPages:
    """The page side of scheduling, over one allocator and an optional prefix cache."""

    def __init__(self, allocator: PageAllocator, cache: RadixCache | None, page_size: int) -> None:
        self.allocator = allocator
        self.cache = cache
        self.page_size = page_size
        # KV tiers (``scheduling.kv_tiers``): with a saver, pages new to the tree are queued to be copied out.
        self.saver: KVSaver | None = None
        self.saves = SaveQueue(allocator)

    def pages_for(self, num_tokens: int) -> int:
        """Pages that hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.page_size)

    def may_fit(self, need: int) -> bool:
        """Whether ``need`` more pages could be had: free ones plus every unlocked cached one.

        An upper bound (an unlocked page a sibling still holds frees nothing
        when evicted); False means no eviction could help.
        """
        evictable = self.cache.num_evictable_pages if self.cache is not None else 0
        return need <= self.allocator.num_free_pages + evictable

    def reserve(self, req: Request, num_tokens: int, *, evict: bool = True) -> bool:
        """Make ``req.pages`` cover ``num_tokens`` tokens, evicting cached pages if needed (and allowed).

        All or nothing: on False no page was added (some may have been evicted).
        """
        need = self.pages_for(num_tokens) - len(req.pages)
        if need <= 0:
            return True
        free = self.allocator.num_free_pages
        if free < need and self.cache is not None and evict:
            self.cache.evict(need - free)
        if self.allocator.num_free_pages < need:
            return False
        req.pages.extend(self.allocator.allocate(need))
        return True

    def trim(self, req: Request, num_tokens: int) -> None:
        """Free ``req``'s pages past those that hold ``num_tokens`` tokens (rejected drafts' KV).

        Pages past the computed tokens are the request's own (shared prefix
        pages are full pages of computed tokens), so this frees them.
        """
        keep = self.pages_for(num_tokens)
        if len(req.pages) > keep:
            self.allocator.free(req.pages[keep:])
            del req.pages[keep:]

    def take_prefix(self, req: Request, match: PrefixMatch) -> None:
        """Start ``req`` from its cached prefix; ``match.node`` is already locked for it."""
        assert not req.pages and req.prefix_node is None
        self.allocator.incref(match.pages)
        req.prefix_node = match.node
        req.pages = list(match.pages)
        req.num_computed_tokens = match.num_tokens

    def release(self, req: Request) -> None:
        """Give back the request's pages (computed ones into the prefix cache, save an embedding
        request's) and its lock."""
        if req.pages:
            if self.cache is not None and req.num_computed_tokens >= self.page_size and req.pooling is None:
                tokens = req.all_token_ids[: req.num_computed_tokens]
                cached = self.cache.insert(tokens, req.pages, req.cache_namespace)
                first, end = cached // self.page_size, len(tokens) // self.page_size
                if self.saver is not None and first < end:
                    picked = self.saver.select(req.cache_namespace, tokens, first, end - first)
                    if picked:
                        self.saves.add([(key, req.pages[i]) for i, key in picked])
            self.allocator.free(req.pages)
            req.pages = []
        if req.prefix_node is not None:
            assert self.cache is not None
            self.cache.unlock(req.prefix_node)
            req.prefix_node = None
        req.num_computed_tokens = 0
